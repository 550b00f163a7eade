"""The target's side of a round: verify the drafts in one forward, plain target steps, settle.

p = target, q = drafter, k = drafts verified this round (0: a plain target step). The same for
every kind of drafter: `verify` runs p once and applies the acceptance rule; `settle` makes the
round's one host sync, then its counters, record and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.decode.acceptance import (
    accept_prefix,
    acceptance_probs,
    expected_alpha,
    greedy_agreement,
    probs_from_logits,
    uniforms,
    verify_sampling,
)
from specdistill.decode.cache import ModelRunner, step_mask
from specdistill.decode.config import DecoderConfig
from specdistill.decode.draft_length.policies import DraftLengthPolicy
from specdistill.decode.lookup import PromptLookup
from specdistill.decode.outputs import DecodeOutput, RoundRecord, VerifiedRow


@dataclass
class RoundState:
    """One `SpeculativeDecoder.generate` call's state, advanced round by round (`tgt`: the
    target p's runner; the drafter q's state lives in its `Drafter`)."""

    tgt: ModelRunner
    mask: torch.Tensor  # (B, capacity) shared slot mask of both caches
    dense: bool  # batch 1: no mask, no explicit positions
    policy: DraftLengthPolicy
    out: DecodeOutput
    done: list[bool]
    t: torch.Tensor  # (B,) pending token, not yet in the target's cache
    pos: torch.Tensor  # (B,) its position
    steps: torch.Tensor  # arange over the widest verify
    generator: torch.Generator | None
    # decoder.lookup at batch 1: the context's n-grams, drafts that cost no drafter forward
    lookup: PromptLookup | None = None


@dataclass(frozen=True)
class Verdict:
    """What one verify forward of p decided for the round, as `settle` and the round read it."""

    draft: torch.Tensor  # (B, k) the drafts verified
    accepted: torch.Tensor  # (B,) drafts accepted per row
    next_token: torch.Tensor  # (B,) p's token after the accepted prefix (correction or bonus)
    # per position: (B, k) greedy agreement, or (B, 2k) sum_x min(p, q) then min(1, p/q)
    figures: torch.Tensor
    target_logits: torch.Tensor  # (B, k + 1, V) p's logits at the verified positions
    width: int  # tokens the forward fed: k + 1, or the compiled width padding it
    cut_lengths: list[int] | None  # drafts each row verifies, when some rows verify fewer


class Verifier:
    """p's side of every round, for one decoder's settings (see the module docstring)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        vocab: int,
        device: torch.device,
        verify_widths: list[int],
        pad_widths: bool,
    ) -> None:
        """vocab: the target's vocabulary size; pad_widths: a compiled target with varying
        lengths pads each verify to the next of `verify_widths` (few compiled shapes)."""
        self.cfg, self.vocab, self.device = cfg, vocab, device
        self.verify_widths, self.pad_widths = verify_widths, pad_widths

    def verify(
        self,
        st: RoundState,
        draft_t: torch.Tensor,
        q: torch.Tensor | None,
        lengths: list[int] | None,
    ) -> Verdict:
        """Verify [t, d_1..d_K] with p in one forward (a compiled target pads to a few widths)
        and apply the acceptance rule. q (B, K, V): None when greedy; lengths: drafts row r
        verifies (None: every row all K)."""
        s, (b, kd), tgt, steps = self.cfg.sampling, draft_t.shape, st.tgt, st.steps
        length, t, dense, generator = tgt.length, st.t, st.dense, st.generator
        vin = torch.cat([t[:, None], draft_t], 1)
        width = self.width(kd)
        if width > kd + 1:
            vin = torch.cat([vin, t[:, None].expand(b, width - kd - 1)], 1)
            if not dense:
                st.mask[:, length + kd + 1 : length + width] = True
        attn = None if dense else step_mask(tgt, st.mask, length + width)
        vpos = None if dense else st.pos[:, None] + steps[:width]
        t_logits = tgt.forward(vin, attn, vpos, keep=width)[:, : kd + 1, : self.vocab]
        len_t = torch.tensor(lengths, device=self.device) if lengths is not None else None
        if s.greedy:  # one argmax serves the verdict and the per-position agreement
            ok, target_tok = greedy_agreement(draft_t, t_logits)
            if len_t is not None:
                ok &= steps[None, :kd] < len_t[:, None]
            n, nxt = accept_prefix(ok, target_tok)
            return Verdict(draft_t, n, nxt, ok.float(), t_logits, width, lengths)
        p = probs_from_logits(t_logits, s)
        q = q if q is not None else torch.zeros_like(p[:, :0])
        accept_p = acceptance_probs(p[:, :kd], q, draft_t, self.cfg.lenience)
        n, nxt = verify_sampling(
            draft_t,
            p,
            q,
            uniforms((b, kd), generator, self.device),
            uniforms((b,), generator, self.device),
            self.cfg.lenience,
            lengths=len_t,
            accept_p=accept_p,
        )
        figures = torch.cat([expected_alpha(p[:, :kd], q), accept_p], 1)
        return Verdict(draft_t, n, nxt, figures, t_logits, width, lengths)

    def width(self, k: int) -> int:
        """Tokens the verify step feeds: k + 1, or the next of a few widths when the target's
        steps are compiled (padding past the drafts is verified and rolled back unread)."""
        if not self.pad_widths:
            return k + 1
        return next(w for w in self.verify_widths if w >= k + 1)

    def settle(
        self,
        st: RoundState,
        active: list[bool],
        verdict: Verdict,
        lengths: list[int],
        lookup: bool = False,
    ) -> list[VerifiedRow]:
        """The round's one host sync, then its counters, record and tokens (`lengths`: drafts
        each row verified; lookup: counted apart too). Marks finished rows in `st.done`;
        returns the rows as the host read them."""
        out, done, v = st.out, st.done, verdict
        k = v.draft.shape[1]
        host = torch.cat([v.draft, v.accepted[:, None], v.next_token[:, None], v.figures], 1)
        host = host.float().tolist()
        rows = [VerifiedRow.from_host(row, k) for row in host]
        out.count_round(rows, active, lengths, lookup)
        if self.cfg.record_probs:
            out.rounds.append(
                RoundRecord(
                    start=[len(tk) for tk in out.tokens],
                    draft=v.draft,
                    accepted=v.accepted,
                    next_token=v.next_token,
                    active=active,
                    target_probs=torch.softmax(v.target_logits.float(), -1),
                    lengths=v.cut_lengths,
                )
            )
        for r, row in enumerate(rows):
            if not done[r]:
                done[r] = self.emit(out.tokens[r], row.emitted())
        return rows

    def emit(self, row: list[int], tokens: list[int]) -> bool:
        """Append up to the budget, stopping after an EOS; True when the row is finished."""
        eos = self.cfg.eos_token_id
        for tok in tokens:
            row.append(tok)
            if tok in eos or len(row) >= self.cfg.max_new_tokens:
                return True
        return False
