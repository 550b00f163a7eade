"""The draft-length policies: per round, how many drafts q proposes before the target p verifies.

p = target, q = drafter. Each policy is deterministic and reads only q and earlier rounds, never
p of the round being drafted, so the acceptance rule stays exact for whatever length it picks
(a length is a stopping time of the draft). None reads a clock.

- `fixed` (the default, what vLLM, SGLang and TRT-LLM serve): gamma drafts every round.
- `heuristic`: `transformers`' assisted-generation schedule, per decode: start at gamma, +2
  after a round whose drafts every row accepted, -1 (at least 1) otherwise; at most max_draft.
- `confidence`: llama.cpp's `--spec-draft-p-min`: draft up to gamma, a row stopping at its
  first draft whose q has its top probability below p_min (that draft is not verified). A round
  where no row is confident enough verifies no draft: a plain target step.
"""

from __future__ import annotations

POLICIES = ("fixed", "heuristic", "confidence")


class DraftLengthPolicy:
    """`fixed`: gamma drafts every round (the base of the other two)."""

    reads_q = False  # the drafter returns each draft's top probability only when this is set

    def __init__(self, gamma: int, max_draft: int, p_min: float = 0.0) -> None:
        self.gamma, self.max_draft, self.p_min = min(gamma, max_draft), max_draft, p_min
        self.k = self.gamma

    def start(self, batch: int) -> None:
        """A new decode of `batch` rows."""
        self.k = self.gamma

    def plan(self, budget: int) -> int:
        """Drafts to propose this round, at most `budget` (what the rows may still emit)."""
        return max(1, min(self.k, budget))

    def keep_drafting(self, tops: list[float], active: list[bool]) -> bool:
        """After a draft whose q had top probability tops[r] in row r: verify it and go on?"""
        return True

    def lengths(self, tops: list[list[float]] | None, drafted: int, batch: int) -> list[int]:
        """Drafts each row verifies out of the `drafted` proposed."""
        return [drafted] * batch

    def observe(self, lengths: list[int], accepted: list[int], active: list[bool]) -> None:
        """The round's outcome: row r verified lengths[r] drafts and accepted accepted[r]."""


class HeuristicLength(DraftLengthPolicy):
    """`transformers`' schedule: +2 after a round every row accepted whole, else -1."""

    def observe(self, lengths, accepted, active) -> None:
        whole = all(n >= k for n, k, a in zip(accepted, lengths, active) if a)
        self.k = min(self.k + 2, self.max_draft) if whole else max(1, self.k - 1)


class ConfidenceLength(DraftLengthPolicy):
    """llama.cpp's p_min: a row stops at its first draft whose q's top probability < p_min."""

    reads_q = True
    _alive: list[bool] | None = None  # this round: rows whose drafts so far were all confident

    def keep_drafting(self, tops: list[float], active: list[bool]) -> bool:
        """Draft on while some unfinished row's drafts have all been confident."""
        alive = self._alive if self._alive is not None else list(active)
        self._alive = [a and t >= self.p_min for a, t in zip(alive, tops)]
        return any(self._alive)

    def lengths(self, tops, drafted, batch) -> list[int]:
        self._alive = None
        out = []
        for row in tops or [[1.0] * drafted] * batch:
            n = 0
            while n < drafted and row[n] >= self.p_min:
                n += 1
            out.append(n)
        return out


POLICY_CLASSES = {
    "fixed": DraftLengthPolicy,
    "heuristic": HeuristicLength,
    "confidence": ConfidenceLength,
}


def make_policy(name: str, gamma: int, max_draft: int, p_min: float = 0.0) -> DraftLengthPolicy:
    """The policy `decoder.draft_length` names (checked by the decoder's config)."""
    return POLICY_CLASSES[name](gamma, max_draft, p_min)
