"""Acceptance as two engines count it, and whether they disagree beyond sampling noise.

Our decoder and another engine count acceptance differently (ours: accepted / drafts tested;
vLLM: its `spec_decode_*` counters; llama.cpp: totals of drafted and accepted tokens), so no
headline figure compares with another as printed. Ours and vLLM's reduce to one per-round
record, because acceptance is a prefix: c_j = rounds whose first j drafts were accepted (ours
`accepted_at[j-1]`, vLLM `per_pos[j-1]`), n = rounds with a draft (ours `trials_at[0]`, vLLM
drafts). From those: mean accepted m = sum_j c_j / n with variance E[L^2] - m^2,
E[L^2] = sum_j (2j - 1) c_j / n; mean acceptance length 1 + m; conditional rate
sum_j c_j / (n + sum_{j<K} c_j); per-position c_j / n.

The mean acceptance lengths are compared with a two-sample z statistic on the per-round L
(`compare`); an engine that reports totals only borrows our per-round spread (under the
hypothesis that both accept alike, both samples share it). Rounds of one sequence are not
independent, so the noise is a lower bound and |z| > 3 (not 2) is called a disagreement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Z_LIMIT = 3.0


@dataclass(frozen=True)
class Acceptance:
    """One engine's acceptance in one mode, from the prefix counts c_1..c_K over n rounds."""

    rounds: int
    prefix_counts: tuple[int, ...]

    @classmethod
    def from_ours(cls, accepted_at: Sequence[int], trials_at: Sequence[int]) -> Acceptance:
        """Our decoder's counters (`DecodeOutput.accepted_at`, `.trials_at`)."""
        return cls(int(trials_at[0]) if trials_at else 0, tuple(int(c) for c in accepted_at))

    @classmethod
    def from_vllm(cls, drafts: int, per_pos: Sequence[int]) -> Acceptance:
        """vLLM's `spec_decode_num_drafts` and `spec_decode_num_accepted_tokens_per_pos`."""
        return cls(int(drafts), tuple(int(c) for c in per_pos))

    @property
    def accepted(self) -> int:
        return sum(self.prefix_counts)

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def variance(self) -> float:
        if not self.rounds:
            return 0.0
        second = sum((2 * j - 1) * c for j, c in enumerate(self.prefix_counts, 1)) / self.rounds
        return max(second - self.mean_accepted**2, 0.0)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafts put to the test (trials stop at a round's first rejection)."""
        tested = self.rounds + sum(self.prefix_counts[:-1])
        return self.accepted / tested if tested else 0.0

    @property
    def by_position(self) -> list[float]:
        return [c / self.rounds if self.rounds else 0.0 for c in self.prefix_counts]

    def figures(self) -> dict[str, Any]:
        """The report's row for this engine."""
        return {
            "rounds": self.rounds,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(1 + self.mean_accepted, 3),
            "accepted_by_position": [round(x, 4) for x in self.by_position],
        }


@dataclass(frozen=True)
class Agreement:
    """Ours vs another engine in one mode: the difference of mean acceptance lengths and its noise."""

    ours: float  # mean acceptance length
    theirs: float
    difference: float  # theirs - ours
    noise: float  # one standard error of the difference
    z: float | None  # None: no noise to measure against (one engine drafted nothing)
    beyond_noise: bool

    def as_dict(self, engine: str, z_digits: int = 4) -> dict[str, Any]:
        """report.json's `agreement` of a mode: the other engine's length under its own name."""
        z = self.z if self.z is None or not math.isfinite(self.z) else round(self.z, z_digits)
        return {"ours": round(self.ours, 4), engine: round(self.theirs, 4),
                "difference": round(self.difference, 4), "noise": round(self.noise, 4),
                "z": z, "beyond_noise": self.beyond_noise}  # fmt: skip


def compare(ours: Acceptance, mean: float, rounds: int, variance: float) -> Agreement:
    """Our mean accepted drafts per round against another engine's `mean` over `rounds` with
    per-round `variance` (a two-sample z statistic; pure)."""
    diff = mean - ours.mean_accepted
    if not ours.rounds or not rounds:
        return Agreement(1 + ours.mean_accepted, 1 + mean, diff, 0.0, None, False)
    se = math.sqrt(ours.variance / ours.rounds + variance / rounds)
    if se == 0.0:  # both engines accepted every draft or none: any difference is real
        z = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    else:
        z = diff / se
    return Agreement(1 + ours.mean_accepted, 1 + mean, diff, se, z, abs(z) > Z_LIMIT)


def agreement(ours: Acceptance, theirs: Acceptance) -> Agreement:
    """Two engines' per-round records compared, each with its own spread."""
    return compare(ours, theirs.mean_accepted, theirs.rounds, theirs.variance)


def totals_agreement(ours: Acceptance, accepted: int, rounds: int) -> Agreement:
    """An engine that reports totals only (accepted drafts, rounds) against ours; its per-round
    spread is taken from ours."""
    return compare(ours, accepted / rounds if rounds else 0.0, rounds, ours.variance)


def token_lists(batches: Sequence[Any]) -> list[list[list[int]]]:
    """The stage's left-padded (ids, mask) batches as each prompt's token ids, batch by batch
    (padding dropped): what another engine is asked, the same prompts as ours."""
    return [[ids[j, mask[j].bool()].tolist() for j in range(ids.shape[0])] for ids, mask in batches]


def strip_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    """A completion without its final EOS (engines differ in whether they return it)."""
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def same_outputs(theirs: Sequence[Sequence[int]], ours: Sequence[Sequence[int]], eos) -> str:
    """`k/n`: prompts whose completion from the other engine equals ours (EOS aside)."""
    same = sum(strip_eos(a, eos) == strip_eos(b, eos) for a, b in zip(theirs, ours))
    return f"{same}/{len(theirs)}"
