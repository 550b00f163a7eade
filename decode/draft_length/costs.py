"""The pure cost and stopping math of per-round draft lengths (tested like `acceptance.py`).

p = target, q = drafter, k = drafts in a round (gamma when fixed), c = one drafter step in target
steps. Cost model (units: one 1-token target step; `DraftCosts`): a round with k >= 1 drafts costs
k c (drafter steps; one forward in all for a parallel drafter) + 1 + `round_overhead` +
k `verify_per_token` (the (k+1)-token verify and the round's glue; where each width was timed,
its own figure, `verify_tokens`, in place of the line) + k `glue_per_draft` (the host's work per
draft: sampling it from q, testing it against p); a round with 0 drafts is a plain target step
and costs 1.

Expected-gain rule (`draft_gain`). With acceptance probabilities a_1..a_k of the drafts (each
given that the ones before were accepted), a round emits E = 1 + sum_j prod_{i<=j} a_i tokens.
Throughput over many rounds is tokens / time, and a rule maximises it when each round maximises
E - R * cost, R being the throughput achievable (Dinkelbach; R >= 1 since target-only decoding
is always there). After j drafts, whose prefix is accepted with probability P_j, drafting m more
with predicted acceptance a each returns P_j (a + a^2 + ... + a^m) tokens and costs
R (cost(j+m) - cost(j)): draft on while some m >= 1 has a positive net gain. Before a round
(j = 0, P_0 = 1) the same comparison decides between drafting and a plain target step: the floor.

Also the step shapes compiled steps see (`verify_widths`, `chunk_widths`). No state, no models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DraftCosts:
    """Round costs in 1-token target steps (p = target, q = drafter).

    c: one drafter step; verify_per_token: what each draft adds to the verify step;
    round_overhead: a speculative round's fixed cost beyond one target step (the verify's
    first token and the round's host-side glue); negative where a 2-token verify costs less than
    a 1-token step (on CPU a 2-row GEMM can stream weights faster than the 1-row GEMV: SmolLM2's
    target, 46 vs 60 ms); parallel: one drafter forward drafts any k.

    verify_tokens: what k = 1..len drafts add to the verify, each width timed on its own
    (`decoder.verify_costs=by_width`); past its end, and when empty, k * verify_per_token. A
    line through two widths misprices the others wherever the kernels favour some widths: on
    CPU a 4-row GEMM can beat a 3-row one, so 3 drafts may cost no more than 2.

    glue_per_draft: host-side work each draft adds to a round beyond the forwards (sampling it,
    its acceptance test and residual): near 0 greedy; at temperature 1 on a small CPU pair a
    few hundredths of a target step per draft, which a 4-draft round's pricing cannot ignore.

    prefill_per_token, prefill_fixed: the drafter's prefill per prompt token, and what each
    prefill costs whatever its length (the call's dispatches, the cache's allocation: most of a
    short prompt's): what a decode's first drafting round pays on top of its own cost when the
    drafter reads the prompt lazily (the floor's decodes), `prefill_cost`; 0: not priced.
    """

    c: float = 0.4
    verify_per_token: float = 0.05
    round_overhead: float = 0.15
    parallel: bool = False
    # parallel: what each proposal beyond the first adds to the one drafter forward (a mask)
    draft_per_token: float = 0.0
    verify_tokens: tuple[float, ...] = ()
    glue_per_draft: float = 0.0
    prefill_per_token: float = 0.0
    prefill_fixed: float = 0.0

    def prefill_cost(self, tokens: int) -> float:
        """The drafter's lazy prefill of `tokens` prompt tokens (0 tokens: nothing to read)."""
        return self.prefill_fixed + self.prefill_per_token * tokens if tokens > 0 else 0.0

    def round_cost(self, k: int) -> float:
        """Cost of a round with k drafts (k = 0: a plain target step, cost 1)."""
        if k <= 0:
            return 1.0
        drafting = self.c + (k - 1) * self.draft_per_token if self.parallel else k * self.c
        return drafting + k * self.glue_per_draft + self.verify_cost(k)

    def verify_cost(self, k: int) -> float:
        """A round's cost beyond its drafting: the verify of k drafts and the round's glue."""
        if k <= len(self.verify_tokens):
            return 1.0 + self.round_overhead + self.verify_tokens[k - 1]
        return 1.0 + self.round_overhead + k * self.verify_per_token

    def linear(self) -> DraftCosts:
        """These costs with every verify width on the line (`decoder.verify_costs=linear`)."""
        return dataclasses.replace(self, verify_tokens=())


def costs_from_mapping(values: Mapping[str, Any]) -> DraftCosts:
    """DraftCosts from a config mapping, as a report's `draft_costs` prints them: numbers for
    c, verify_per_token, round_overhead, draft_per_token, glue_per_draft, prefill_per_token,
    prefill_fixed, and a list for verify_tokens. Raises TypeError or ValueError on anything
    else (callers name their config field)."""
    fields = dict(values)
    table = fields.pop("verify_tokens", None) or ()
    if isinstance(table, str | bytes) or not isinstance(table, Iterable):
        raise ValueError(f"verify_tokens={table!r} is not a list of numbers")
    return DraftCosts(
        **{k: float(v) for k, v in fields.items()}, verify_tokens=tuple(float(v) for v in table)
    )


def expected_tokens(accept: Sequence[float]) -> float:
    """Tokens a round emits on average: 1 + sum_j prod_{i<=j} a_i (a_j: acceptance of draft j
    given drafts 1..j-1 were accepted; the 1 is the correction or bonus token)."""
    total, prefix = 1.0, 1.0
    for a in accept:
        prefix *= a
        total += prefix
    return total


def draft_gain(
    prefix_prob: torch.Tensor,
    next_accept: torch.Tensor,
    drafted: int,
    max_k: int,
    costs: DraftCosts,
    rate: torch.Tensor,
    first_accept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Net expected gain (tokens - rate * cost) of drafting m = 0..max_k-drafted more tokens.

    prefix_prob (B,): probability that the `drafted` drafts so far are all accepted; the next
    draft is accepted with probability first_accept (B,) (default next_accept), each one after it
    with next_accept (B,); rate (B,): throughput to beat (tokens per target step).
    Returns (B, M+1) gains, column m for m more drafts, column 0 being 0.
    """
    m = max(max_k - drafted, 0)
    a = next_accept.double().clamp(0.0, 1.0)[:, None]
    first = a if first_accept is None else first_accept.double().clamp(0.0, 1.0)[:, None]
    steps = torch.arange(m, dtype=torch.float64)
    # P(the first l more drafts are all accepted), l = 1..m
    reach = first * a**steps
    tokens = reach.cumsum(-1) * prefix_prob.double()[:, None]  # (B, M)
    base = costs.round_cost(drafted)
    extra = torch.tensor(
        [costs.round_cost(drafted + i) - base for i in range(1, m + 1)], dtype=torch.float64
    )
    gains = tokens - rate.double()[:, None] * extra
    return torch.cat([torch.zeros_like(gains[:, :1]), gains], 1)


def best_length(accept: Sequence[float], costs: DraftCosts, rate: float = 1.0) -> int:
    """k in 0..len(accept) maximising E_k - rate * cost(k) when every draft's acceptance is known
    (parallel drafting: verify the k best-paying proposals of one forward)."""
    best, best_v = 0, 1.0 - rate * costs.round_cost(0)
    for k in range(1, len(accept) + 1):
        v = expected_tokens(accept[:k]) - rate * costs.round_cost(k)
        if v > best_v + 1e-12:
            best, best_v = k, v
    return best


def best_more(
    prefix: float,
    first: float,
    nxt: float,
    increments: Sequence[float],
    rate: float,
) -> tuple[int, float]:
    """`draft_gain` for one row in plain floats (the decoder calls it per drafter step, where
    tensor ops on a few numbers would cost more than the arithmetic): the best number of further
    drafts m and its net gain; increments[i] = cost(drafted + i + 1) - cost(drafted)."""
    best, best_g, reach, tokens = 0, 0.0, prefix * first, 0.0
    for i, inc in enumerate(increments):
        if i:
            reach *= nxt
        tokens += reach
        g = tokens - rate * inc
        if g > best_g + 1e-12:
            best, best_g = i + 1, g
    return best, best_g


def modeled_speedup(draft_lengths: Sequence[int], tokens: int, costs: DraftCosts) -> float:
    """A decode's speedup by the cost model: the tokens it emitted over the modeled time of its
    rounds, in target steps (draft_lengths[k]: rounds that verified k drafts, k = 0 a plain
    target step; batch 1), against target-only decoding's one token per step. The adaptive
    policies' counterpart of the fixed-gamma formula, which assumes gamma drafts every round."""
    cost = sum(n * costs.round_cost(k) for k, n in enumerate(draft_lengths))
    return tokens / cost if cost > 0 else 0.0


def verify_widths(max_k: int) -> list[int]:
    """Verify widths (drafts + 1) a compiled target is given: k in {0, 1, 2, 4, 8, ...} and
    max_k, so CUDA graphs / inductor see a few shapes; a round's drafts are padded up."""
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


# The verify's first token may cost less than a 1-token step (round_overhead < 0), within reason:
# a timing below this is noise, not a kernel.
MIN_OVERHEAD = -0.5
