"""Parallel drafting (PARD): one drafter forward proposes all k drafts of a round.

p = target, q = drafter. A parallel drafter was trained to read a context followed by k-1 copies
of a mask token and predict, at the context's last position and at every mask, the next k
tokens at once (`specdistill.distill.parallel`). A round then costs one drafter forward and one
verify, whatever k: the drafter reads the tokens accepted since its last forward (the accepted
drafts and the pending token t) plus k-1 masks; the logits at t give q_1, mask i gives q_{i+1};
draft i is sampled (or argmaxed) from q_i alone. The masks' cache slots are then rolled back, so
the drafter's cache holds real tokens only, in the slot layout the target shares
(`specdistill.decode.cache`): the masks sit in the slots the verify later writes d_1..d_{k-1}
to, and the accepted drafts are fed to the drafter at the start of its next forward.

Lossless: q_i depends on the context before the round only, never on d_1..d_{i-1}; it is still a
distribution over position i given the prefix, which is all the acceptance rule needs
(min(1, p/q) then the residual max(0, p - q)); drafts are independent given the context, and
the verify reads q_i at each position exactly as in the autoregressive path. Greedy drafts are
argmaxes, verified by agreement with the target's argmax.
"""

from __future__ import annotations

import torch

from specdistill.data.pairs import match_vocab
from specdistill.data.runtime import ConfigError
from specdistill.decode.acceptance import (
    accept_prefix,
    expected_alpha,
    greedy_agreement,
    probs_from_logits,
    sample_from,
    uniforms,
    verify_sampling,
)

DRAFTING = ("autoregressive", "parallel")


def resolve_mask_token(drafter, configured: int | None, vocab: int) -> int:
    """The mask token id: configured, else the drafter's `config.mask_token_id` (exported
    parallel drafters carry it); must be an id of the shared vocabulary."""
    mask_id = configured
    if mask_id is None:
        mask_id = getattr(getattr(drafter, "config", None), "mask_token_id", None)
    if mask_id is None:
        raise ConfigError(
            "decoder.drafting=parallel needs a mask token: set decoder.mask_token_id or use a "
            "drafter whose config.json has mask_token_id (a parallel-distilled drafter)"
        )
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
        raise ConfigError(f"decoder.mask_token_id={mask_id!r} must be a token id in 0..{vocab - 1}")
    return mask_id


def draft_parallel(dec, dft, mask, lag, lag_pos, t, pos, k: int, dense: bool, generator):
    """One drafter forward over [lag, t, k-1 masks]; returns (drafts (B, k), q (B, k, V) or
    None when greedy). The masks' slots are dropped from the drafter's cache before returning."""
    s, b = dec.cfg.sampling, t.shape[0]
    masks = torch.full((b, k - 1), dec.mask_token_id, dtype=t.dtype, device=t.device)
    x = torch.cat([lag, t[:, None], masks], 1)
    keep_from = dft.length + lag.shape[1] + 1  # slots from here on are masks
    xpos = None
    if not dense:
        xpos = torch.cat([lag_pos, pos[:, None] + dec._arange(k)], 1)
    attn = None if dense else dec._attn(dft, mask, dft.length + x.shape[1])
    logits = match_vocab(dft.forward(x, attn, xpos, keep=k), dec.vocab)
    dft.rollback(keep_from)
    if s.greedy:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, s)
    return sample_from(q, uniforms((b, k), generator, dec.device)), q


@torch.inference_mode()
def generate_parallel(dec, input_ids, attention_mask=None, generator=None):
    """`SpeculativeDecoder.generate` for `decoder.drafting=parallel` (fixed gamma)."""
    from specdistill.decode.speculative import DecodeOutput

    cfg, s, g = dec.cfg, dec.cfg.sampling, dec.max_draft
    ids, mask0 = dec._prepare(input_ids, attention_mask)
    b, plen = ids.shape
    dense = b == 1
    slots = dec.spec_slots(b, plen)
    tgt, dft = dec._runner(dec.target, slots), dec._runner(dec.drafter, slots)
    mask = torch.zeros(b, dec._capacity(slots), dtype=torch.bool, device=dec.device)
    mask[:, :plen] = mask0
    t, pos = dec._prefill([tgt, dft], ids, mask0, dense)
    out = DecodeOutput(
        tokens=[[] for _ in range(b)],
        accepted_at=[0] * g,
        trials_at=[0] * g,
        draft_lengths=[0] * (g + 1),
    )
    done = [False] * b
    # accepted drafts of the last round, which the drafter has not read yet (and their positions)
    lag = ids.new_zeros(b, 0)
    lag_pos = lag.clone()
    steps = dec._arange(g + 1)
    while not all(done):
        length = tgt.length
        active = [not d for d in done]
        k = dec._draft_width(out.tokens, done)
        if not dense:
            mask[:, length : length + k + 1] = True  # t, then the masks / drafts
        draft_t, q = draft_parallel(dec, dft, mask, lag, lag_pos, t, pos, k, dense, generator)
        out.drafter_forwards += 1
        vin = torch.cat([t[:, None], draft_t], 1)
        attn = None if dense else dec._attn(tgt, mask, length + k + 1)
        vpos = None if dense else pos[:, None] + steps[: k + 1]
        t_logits = tgt.forward(vin, attn, vpos, keep=k + 1)[:, :, : dec.vocab]
        out.target_forwards += 1
        if s.greedy:
            ok, target_tok = greedy_agreement(draft_t, t_logits)
            n, nxt = accept_prefix(ok, target_tok)
            alpha_pos = ok.float()
        else:
            p = probs_from_logits(t_logits, s)
            n, nxt = verify_sampling(
                draft_t,
                p,
                q,
                uniforms((b, k), generator, dec.device),
                uniforms((b,), generator, dec.device),
                cfg.lenience,
            )
            alpha_pos = expected_alpha(p[:, :k], q)
        host = dec._settle(out, done, active, (draft_t, n, nxt, alpha_pos), t_logits, [k] * b)
        maxn = max(row[k] for row in host)
        if not dense:  # rows that accepted less than the longest keep masked holes
            mask[:, length + 1 : length + k + 1] &= steps[None, :k] < n[:, None]
        tgt.rollback(length + 1 + maxn)
        lag = draft_t[:, :maxn]
        lag_pos = pos[:, None] + 1 + steps[:maxn]
        pos = pos + 1 + n
        t = nxt
    return out
