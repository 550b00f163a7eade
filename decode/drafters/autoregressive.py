"""Autoregressive drafting: the drafter q proposes a round's k drafts in k 1-token steps.

p = target, q = drafter, k = drafts this round (gamma when fixed). The first step also feeds the
tokens the drafter lags behind: the last draft of a round some row accepted whole (the drafter
never read it) and the tokens of plain target steps (the floor), then the pending token t. A
draft-length policy that reads q may stop the drafting after any step (`keep_drafting`), which
is a stopping time of the draft and keeps the rule lossless. After the verify the drafter's
cache is rolled back to the longest accepted prefix, or, when it is all accepted, keeps it and
reads the last draft first next round.
"""

from __future__ import annotations

import torch

from specdistill.decode.draft_length.costs import chunk_widths
from specdistill.decode.drafters.base import Drafter, KeepDrafting, Proposal, confidences


class AutoregressiveDrafter(Drafter):
    """k drafter steps per round (`decoder.drafting=autoregressive`, the default)."""

    def start(self, ids, prompt_mask, mask, dense, slots, lazy, cut: int = 0) -> None:
        super().start(ids, prompt_mask, mask, dense, slots, lazy, cut)
        # tokens in the target's cache the drafter has not read yet, oldest first
        self.lag: list[torch.Tensor] = []
        self.drafted = 0

    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
        shadow: int = 0,
    ) -> Proposal:
        """k 1-token steps (the first over lag + t); stops early when `keep_drafting` says so.
        The first step's logits at the lag's last `shadow` tokens give `Proposal.shadow`."""
        self._prefill()
        x = torch.stack([*self.lag, t], 1)
        self.lag = []
        n = x.shape[1]
        xpos = None if self.dense else pos[:, None] - n + 1 + torch.arange(n, device=self.device)
        x, xpos = self._catch_up(x, xpos)
        s = 0 if self.compiled else min(shadow, x.shape[1] - 1)
        seen = None
        want_q = keep_drafting is not None
        drafts, qs, confs = [], [], []
        for i in range(k):
            logits = self._forward(x, xpos, keep=1 + s if i == 0 else 1)
            if i == 0 and s:  # logits at x[-s-1:-1] predicted x[-s:]
                seen = self._shadow(logits[:, :-1], x[:, -s:])
            d, q = self._draw(logits[:, -1], generator, want_q)
            drafts.append(d)
            if not self.sampling.greedy:
                qs.append(q)
            if want_q:  # the drafter's probability of its own draft (q only)
                conf = confidences(q, d)
                confs.append(conf)
                if i + 1 < k and not keep_drafting(i + 1, conf):
                    break
            if i + 1 < k:
                x = d[:, None]
                xpos = None if self.dense else pos[:, None] + i + 1
        self.drafted = len(drafts)
        return Proposal(
            tokens=torch.stack(drafts, 1),
            q=torch.stack(qs, 1) if qs else None,
            conf=[list(c) for c in zip(*confs)] or None,
            forwards=len(drafts),
            shadow=seen,
        )

    def _catch_up(self, x: torch.Tensor, xpos: torch.Tensor | None):
        """Feed all but the last chunk of x (lag, then t) in power-of-two chunks when steps are
        compiled (a few shapes); returns the last chunk, which the first draft step reads."""
        if x.shape[1] <= 2 or not self._chunked:
            return x, xpos
        return self._feed(x, xpos, chunk_widths(x.shape[1])[:-1])

    def skip(self, t: torch.Tensor, pos: torch.Tensor) -> None:
        self.lag.append(t)  # the target sees t now, the drafter in its next drafting round

    def accept(
        self, drafts: torch.Tensor, accepted: int, new_length: int, pos: torch.Tensor
    ) -> None:
        """The drafter read t and every draft but the last: a row that accepted all of them
        leaves the last draft to feed first next round; otherwise roll back like the target."""
        if accepted == self.drafted:
            self.lag = [drafts[:, -1]]
        else:
            self.rollback(new_length)

    def draft_widths(self, k: int) -> tuple[int, ...]:
        return (1,) * k

    def warm_shapes(self, adaptive: bool) -> tuple[tuple[int, int], ...]:
        """1-token drafts and catch-ups: 2 tokens after a fully accepted round, powers of two
        after the floor's plain target steps."""
        catch = (2, 4, 8, 16) if adaptive else (2,)
        return ((1, 1), *((w, 1) for w in catch))
