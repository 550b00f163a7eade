"""The pure cost model of a speculative round, and the draft count K it recommends.

p = target, q = drafter, K = drafts a round, c = one drafter step in 1-token target steps. A
round costs K c (parallel: c + (K - 1) draft_per_token) plus its verify, 1 + K verify_per_token.
With acceptance a_j by draft position (given drafts 1..j-1 were accepted), a round emits
E(K) = 1 + sum_j prod_{i<=j} a_i tokens, and decoding runs E(K) / cost(K) times as fast as
target-only (Leviathan et al.'s formula when every a_j is one alpha); `recommend_k` maximises it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftCosts:
    """Round costs in 1-token target steps (see the module docstring; p target, q drafter)."""

    c: float = 0.1
    verify_per_token: float = 0.0
    parallel: bool = False
    draft_per_token: float = 0.0  # parallel: what each proposal past the first adds

    def round_cost(self, k: int) -> float:
        """A round with k drafts (k = 0: a plain target step, cost 1)."""
        if k <= 0:
            return 1.0
        drafting = self.c + (k - 1) * self.draft_per_token if self.parallel else k * self.c
        return drafting + 1.0 + k * self.verify_per_token


def costs_from_mapping(values: Mapping[str, Any], parallel: bool = False) -> DraftCosts:
    """DraftCosts from a config mapping of numbers (c, verify_per_token, draft_per_token).
    Raises ValueError naming the bad key (callers name their config field)."""
    allowed = {"c", "verify_per_token", "draft_per_token"}
    extra = sorted(set(values) - allowed)
    if extra:
        raise ValueError(f"unknown key(s) {extra}; use {sorted(allowed)}")
    out: dict[str, float] = {}
    for key, raw in values.items():
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 <= raw < 100:
            raise ValueError(f"{key}={raw!r} must be a number in [0, 100)")
        out[key] = float(raw)
    return DraftCosts(**out, parallel=parallel)


def costs_from_steps(
    c: float, verify_cost: float, gamma: int, parallel: bool = False
) -> DraftCosts:
    """The cost model from step costs measured at one gamma: c (a drafter step, or a parallel
    drafter's one forward, in target steps) and the (gamma+1)-token verify in target steps, its
    part beyond one step spread evenly over the gamma drafts (exact at that width, linear around
    it). A verify under one target step is priced as one: the model has no term for a cheaper
    wide step, and a negative per-draft cost would price long rounds at nothing."""
    if gamma < 1:
        raise ValueError(f"gamma={gamma}: the verify covers at least one draft")
    return DraftCosts(c=c, verify_per_token=max(verify_cost - 1.0, 0.0) / gamma, parallel=parallel)


def expected_tokens(accept: Sequence[float]) -> float:
    """Tokens a round emits on average: 1 + sum_j prod_{i<=j} a_i (a_j: acceptance of draft j
    given drafts 1..j-1 were accepted; the 1 is the correction or bonus token)."""
    total, prefix = 1.0, 1.0
    for a in accept:
        prefix *= a
        total += prefix
    return total


def speedup_at(accept: Sequence[float], k: int, costs: DraftCosts) -> float:
    """The modeled speedup over target-only decoding of rounds of k drafts, from the first k
    acceptances by position."""
    if k < 0 or k > len(accept):
        raise ValueError(f"k={k} needs acceptance at positions 1..{k}; have {len(accept)}")
    return expected_tokens(accept[:k]) / costs.round_cost(k)


def recommend_k(accept: Sequence[float], costs: DraftCosts) -> tuple[int, float]:
    """(K, modeled speedup): the K in 1..len(accept) with the highest `speedup_at` (the smallest
    such K on a tie). The speedup may be below 1: then no K pays at these costs, and the
    caller says so (an engine's K is at least 1). Raises ValueError when nothing was measured."""
    if not accept:
        raise ValueError("no acceptance by position was measured: nothing to recommend K from")
    best, rate = 1, speedup_at(accept, 1, costs)
    for k in range(2, len(accept) + 1):
        s = speedup_at(accept, k, costs)
        if s > rate + 1e-12:
            best, rate = k, s
    return best, rate


def speedup_table(accept: Sequence[float], costs: DraftCosts) -> list[float]:
    """The modeled speedup at every K in 1..len(accept), for the report's K sweep."""
    return [round(speedup_at(accept, k, costs), 4) for k in range(1, len(accept) + 1)]


def verify_widths(max_k: int) -> list[int]:
    """Verify widths (drafts + 1) a compiled target is given: k in {0, 1, 2, 4, 8, ...} and
    max_k, so CUDA graphs see a few shapes; a round's drafts are padded up to the next."""
    ks = {0, max_k} | {1 << i for i in range(int(math.log2(max(max_k, 1))) + 1)}
    return sorted(k + 1 for k in ks if k <= max_k)


def chunk_widths(n: int, max_width: int = 16) -> list[int]:
    """Split an n-token drafter catch-up into few shapes: powers of two, largest first."""
    out = []
    while n > 0:
        w = min(1 << (n.bit_length() - 1), max_width)
        out.append(w)
        n -= w
    return out
