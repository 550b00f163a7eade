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
    probs_from_logits,
    sample_from,
    uniforms,
)
from specdistill.decode.draft_length import chunk_widths

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
    """One drafter forward over [lag, t, k-1 masks]; returns (drafts (B, k), q (B, k, V), or
    for greedy drafts their softmax when a draft-length policy reads confidences, else None).
    The masks' slots are dropped from the drafter's cache before returning."""
    s, b = dec.cfg.sampling, t.shape[0]
    lag, lag_pos = _feed_excess(dec, dft, mask, lag, lag_pos, dense)
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
        reads_q = dec.cfg.draft_length == "confidence"
        return logits.argmax(-1), torch.softmax(logits.float(), -1) if reads_q else None
    q = probs_from_logits(logits, s)
    return sample_from(q, uniforms((b, k), generator, dec.device)), q


def _feed_excess(dec, dft, mask, lag, lag_pos, dense: bool):
    """Compiled drafter steps see a few shapes (warmed up: lag 0..max_draft): a longer lag,
    left by the floor's plain target steps, is fed first in power-of-two chunks."""
    excess = lag.shape[1] - dec.max_draft
    if excess <= 0 or not (dec.compile and dft.static):
        return lag, lag_pos
    start = 0
    for w in chunk_widths(excess):
        cpos = None if dense else lag_pos[:, start : start + w]
        attn = None if dense else dec._attn(dft, mask, dft.length + w)
        dft.forward(lag[:, start : start + w], attn, cpos, keep=1)
        start += w
    return lag[:, start:], lag_pos[:, start:]


@torch.inference_mode()
def generate_parallel(dec, input_ids, attention_mask=None, generator=None):
    """`SpeculativeDecoder.generate` for `decoder.drafting=parallel`.

    Draft lengths (`decoder.draft_length`): `fixed` verifies gamma drafts a round; `heuristic`
    changes the round's proposals by transformers' schedule; `confidence` proposes the running
    averages' best m + 2 (at most max_draft) in the one forward, then verifies the prefix whose
    calibrated expected tokens best pay for the verify (`ConfidenceLength.verify_lengths`: q
    only, so the output stays the target's). Both
    adaptive policies keep the floor: a round may be a plain target step, whose token the
    drafter reads with the next round's forward."""
    from specdistill.decode.speculative import DecodeOutput

    cfg, g = dec.cfg, dec.max_draft
    adaptive = cfg.draft_length != "fixed"
    ids, mask0 = dec._prepare(input_ids, attention_mask)
    b, plen = ids.shape
    policy = None
    if adaptive:
        policy = dec.get_policy(ids[:, mask0[0]][:1])
        policy.set_costs(dec.draft_costs(ids[:, mask0[0]][:1], b))
        policy.start(b)
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
    # tokens the drafter has not read yet: the accepted drafts of the last round and the
    # tokens of plain target steps (and their positions)
    lag = ids.new_zeros(b, 0)
    lag_pos = lag.clone()
    steps = dec._arange(dec.verify_widths[-1])
    while not all(done):
        length = tgt.length
        active = [not d for d in done]
        k = dec._draft_width(out.tokens, done)
        if policy is not None:
            k = policy.plan(k, active).k
        if k == 0:  # the floor: a plain target step
            if not dense:
                mask[:, length : length + 1] = True
            lag = torch.cat([lag, t[:, None]], 1)
            lag_pos = torch.cat([lag_pos, pos[:, None]], 1)
            t = dec._target_step(tgt, mask, t, pos, dense, out, active, done, generator)
            pos = pos + 1
            policy.observe_step(active)
            continue
        if not dense:
            mask[:, length : length + k + 1] = True  # t, then the masks / drafts
        draft_t, q = draft_parallel(dec, dft, mask, lag, lag_pos, t, pos, k, dense, generator)
        out.drafter_forwards += 1
        conf = None
        lengths = [k] * b
        if policy is not None:
            if policy.reads_q:  # the drafter's probability of each of its drafts (q only)
                conf = q.gather(-1, draft_t[..., None])[..., 0].tolist()
                lengths = policy.verify_lengths(conf, active)
            else:
                lengths = policy.lengths(k)
        kd = max(lengths)
        row_cut = any(n < kd for n in lengths)
        if kd < k:
            draft_t = draft_t[:, :kd]
            q = None if q is None else q[:, :kd]
            if not dense:  # slots planned for proposals that are not verified
                mask[:, length + kd + 1 : length + k + 1] = False
        n, nxt, alpha_pos, t_logits, width = dec._verify(
            tgt, mask, t, pos, draft_t, q, lengths if row_cut else None, dense, generator, steps
        )
        out.target_forwards += 1
        host = dec._settle(
            out, done, active, (draft_t, n, nxt, alpha_pos), t_logits, lengths, row_cut
        )
        n_list = [row[kd] for row in host]
        if policy is not None:
            policy.observe(lengths, n_list, active, conf)
        maxn = max(n_list)
        if not dense:  # rows that accepted less than the longest keep masked holes
            mask[:, length + 1 : length + width] &= steps[None, : width - 1] < n[:, None]
        tgt.rollback(length + 1 + maxn)
        lag = draft_t[:, :maxn]
        lag_pos = pos[:, None] + 1 + steps[:maxn]
        pos = pos + 1 + n
        t = nxt
    return out
