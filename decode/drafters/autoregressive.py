"""Autoregressive drafting: the drafter q proposes a round's k drafts in k 1-token steps.

p = target, q = drafter, k = drafts this round (gamma when fixed). The first step also feeds the
tokens the drafter lags behind (the last draft of a round some row accepted whole, which the
drafter never read, and the tokens of prompt-lookup rounds), then the pending token t. A
draft-length policy that reads q may stop the drafting before any draft (`keep_drafting`), a
stopping time of the draft that keeps the rule lossless. After the verify the drafter's cache
is rolled back to the longest accepted prefix, or, when that is longer than what it read, keeps
it and reads the missing draft first next round.
"""

from __future__ import annotations

import torch

from specdistill.decode.draft_length.costs import chunk_widths
from specdistill.decode.drafters.base import Drafter, KeepDrafting, Proposal


class AutoregressiveDrafter(Drafter):
    """k drafter steps per round (`decoder.drafting=autoregressive`, the default)."""

    def start(self, ids, prompt_mask, mask, dense, slots, cut: int = 0) -> None:
        super().start(ids, prompt_mask, mask, dense, slots, cut)
        # tokens in the target's cache the drafter has not read yet, oldest first
        self.lag: list[torch.Tensor] = []
        self.fed = 0

    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
    ) -> Proposal:
        """Up to k 1-token steps, the first over lag + t."""
        x = torch.stack([*self.lag, t], 1)
        self.lag = []
        n = x.shape[1]
        xpos = None if self.dense else pos[:, None] - n + 1 + torch.arange(n, device=self.device)
        x, xpos = self._catch_up(x, xpos)
        logits = self._forward(x, xpos, keep=1)[:, -1]

        def feed(d: torch.Tensor, i: int) -> torch.Tensor:
            dpos = None if self.dense else pos[:, None] + i + 1
            return self._forward(d[:, None], dpos, keep=1)[:, -1]

        return self._steps(logits, k, generator, keep_drafting, feed)

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
        """The drafter read t and its first `fed` drafts: a longer accepted prefix leaves the
        rest (one draft) to feed first next round; a shorter one rolls back like the target."""
        if accepted > self.fed:
            self.lag = list(drafts[:, self.fed : accepted].unbind(1))
        elif accepted < self.fed:
            self.rollback(new_length)

    def warm_shapes(self) -> tuple[tuple[int, int], ...]:
        """1-token drafts and 2-token catch-ups (t after a round accepted whole)."""
        return ((1, 1), (2, 1))
