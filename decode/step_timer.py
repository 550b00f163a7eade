"""The decoder's public timing interface: a target step, a verify of k drafts, a draft step.

p = target, q = drafter, c = drafter step time / target step time. Whatever prices a round (the
draft-length policies' `DraftCosts`, the validate stage's c and verify costs, the benches) times
the decoder's own runners here: the same caches, compiled steps, CPU linears and draft head as a
decode, with no reach into the decoder's private parts. Each model's cache is prefilled with the
prompt but its last token; a timed step feeds that token repeated `width` times. Batched ids
(B > 1) are timed on the masked path with explicit positions, as batched decodes run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specdistill.decode.cache import ModelRunner, step_mask
from specdistill.decode.prefill_memo import PrefillMemo, prefill_timed

ROLES = ("target", "drafter")


class StepTimer:
    """Seconds per forward of the target p or the drafter q at a prompt's length.

    `make_runner[role](slots)` builds that role's runner exactly as the decoder would;
    `draft_widths(k)` gives the tokens fed by each drafter forward of a round of k drafts (a
    drafting strategy's steady state: k 1-token steps, or one forward for a parallel drafter);
    `drafter_ids` maps the target's token ids into the drafter's (identity for a shared vocabulary).
    """

    def __init__(
        self,
        ids: torch.Tensor,
        slots: int,
        make_runner: dict[str, Callable[[int], ModelRunner]],
        draft_widths: Callable[[int], tuple[int, ...]],
        drafter_ids: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
        prefill_memo: PrefillMemo | None = None,
    ) -> None:
        """prefill_memo: the decoder's (decode.prefill_memo): a batch-1 prompt's prefill is the
        decodes', restored rather than run again (at long context it costs more than the steps
        timed here)."""
        self.memo = prefill_memo
        self.ids, self.slots, self.device = ids, slots, ids.device
        self.make_runner, self.draft_widths = make_runner, draft_widths
        self.role_ids = {"target": ids, "drafter": drafter_ids(ids)}
        self.dense = ids.shape[0] == 1
        self.runners: dict[str, tuple[ModelRunner, torch.Tensor]] = {}
        self.prefill_seconds: dict[str, float] = {}  # each role's prompt prefill, as timed
        self.build_seconds: dict[str, float] = {}  # building each role's runner, as timed

    def _runner(self, role: str) -> tuple[ModelRunner, torch.Tensor]:
        """The role's runner (built and prefilled on first use) and its all-ones slot mask."""
        if role not in self.runners:
            t0 = time.perf_counter()
            runner = self.make_runner[role](self.slots)
            self.build_seconds[role] = time.perf_counter() - t0
            ids = self.role_ids[role]
            mask = torch.ones(ids.shape[0], runner.capacity, dtype=torch.bool, device=self.device)
            self.runners[role] = (runner, mask)
            # the prompt but its last token, fed as a decode's prefill feeds it (all slots valid)
            pre = prefill_timed(runner, ids, mask[:, : ids.shape[1]], self.dense, self.memo)
            self.prefill_seconds[role] = pre.seconds
        return self.runners[role]

    def prefill(self, role: str) -> float:
        """Seconds per prompt token of the role's prefill of the prompt (but its last token),
        timed when it ran (a prefill memo's restore reports the run it kept)."""
        self._runner(role)
        return self.prefill_seconds[role] / max(1, self.role_ids[role].shape[1] - 1)

    @torch.inference_mode()
    def prefill_call(
        self, role: str, n: int, reps: int = 3, before: Callable[[], None] | None = None
    ) -> float:
        """Median seconds of one lazy prefill of the prompt's first n tokens by `role` (fed as
        a decode feeds them: followed by the token that opens the first round), as a decode's
        first drafting round pays it: a fresh runner built and prefilled (no memo). With
        `prefill` at the whole prompt it splits a prefill into a fixed part and a part per
        token: a short prompt's drafter prefill is mostly the fixed part (the call's dispatches
        and the cache's allocation), which a per-token price alone misses. `before`: run
        (untimed) ahead of each rep, e.g. target steps that evict the drafter's weights as a
        decode's steps do before its first drafting round."""
        ids = self.role_ids[role][:, : n + 1]
        times = []
        for _ in range(reps):
            if before is not None:
                before()
            self._sync()
            t0 = time.perf_counter()
            runner = self.make_runner[role](self.slots)
            mask = torch.ones(ids.shape[0], n + 1, dtype=torch.bool, device=self.device)
            prefill_timed(runner, ids, mask, self.dense, None)
            self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _step(self, role: str, x: torch.Tensor) -> None:
        runner, mask = self.runners[role]
        n = x.shape[1]
        if self.dense:
            runner.forward(x, keep=n)
            return
        attn = step_mask(runner, mask, runner.length + n)
        pos = (runner.length + torch.arange(n, device=self.device)).expand(x.shape[0], n)
        runner.forward(x, attn, pos, keep=n)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, role: str, width: int, reps: int = 4, grow: bool = False) -> float:
        """Seconds per forward of `width` tokens (all logits kept) by `role` (target or drafter),
        over `reps` forwards. Each forward is rolled back, so every rep times the same step;
        `grow`: 1-token forwards run back to back as a decode runs them (the cache grows, then
        is rolled back once the block is timed)."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}: use target or drafter")
        runner, _ = self._runner(role)
        base, x = runner.length, self.role_ids[role][:, -1:].repeat(1, width)
        self._sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            self._step(role, x)
            if width > 1 or not grow:
                runner.rollback(base)
        self._sync()
        seconds = time.perf_counter() - t0
        runner.rollback(base)
        return seconds / reps

    def target_step(self, reps: int = 4, grow: bool = True) -> float:
        """One 1-token target step (the unit every cost is expressed in)."""
        return self.forward("target", 1, reps, grow)

    def verify(self, k: int, reps: int = 4) -> float:
        """The target's verify of k drafts: one (k+1)-token forward."""
        return self.forward("target", k + 1, reps)

    def draft(self, k: int = 1, reps: int = 4, grow: bool = True) -> float:
        """The drafter's forwards of a round of k drafts, in the drafting strategy's steady state
        (autoregressive: k 1-token steps; parallel: one forward over an accepted draft, the
        pending token and k-1 masks)."""
        return sum(self.forward("drafter", w, reps, grow) for w in self.draft_widths(k))
