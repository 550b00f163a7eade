"""The floor's decision, and a hold carried from one call into the next.

p = target, q = drafter. Before a round the floor (`DraftLengthPolicy._pays`) weighs a plain
target step against rounds of m >= 1 drafts at the rows' running acceptance: some m must yield
more tokens than the throughput already realized (`rate`, at least a plain step's one token a
step) buys with its extra cost. These tests check it against brute force (every accept/reject
outcome of a round enumerated), that a hold carried over from the previous call ends when
this call's starting averages say drafting pays, and that a decode that never drafts never
builds the drafter's cache.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.decode.draft_length import DraftCosts, make_policy
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import greedy_reference, prompts, truncated_copy


def brute_tokens(accept: list[float]) -> float:
    """Expected tokens of a round whose j-th draft is accepted with probability accept[j] given
    the ones before: every outcome enumerated, the accepted prefix plus the target's token."""
    total = 0.0
    for outcome in itertools.product([True, False], repeat=len(accept)):
        weight = 1.0
        for ok, a in zip(outcome, accept):
            weight *= a if ok else 1.0 - a
        n = next((j for j, ok in enumerate(outcome) if not ok), len(accept))
        total += weight * (n + 1)
    return total


@pytest.mark.parametrize("parallel", [False, True])
def test_the_floor_drafts_where_some_round_beats_the_realized_rate(parallel):
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        c, per_token, overhead = (0.6 * torch.rand(3, generator=g)).tolist()
        costs = DraftCosts(
            c=c, verify_per_token=per_token, round_overhead=overhead, parallel=parallel
        )
        pol = make_policy("confidence", 4, 4, costs)
        pol.start(1)
        pol.first = [float(torch.rand(1, generator=g))]
        pol.follow = [float(torch.rand(1, generator=g))]
        pol.later = [torch.rand(3, generator=g).tolist()]
        realized = 0.5 + float(torch.rand(1, generator=g))  # 0.5-1.5 (below 1 the bar is 1)
        pol.tokens, pol.cost = [5.0 * realized], [5.0]
        rate = max(1.0, realized)
        later = pol.later[0] if parallel else [pol.follow[0]] * 3
        rounds = [[pol.first[0], *later[: m - 1]] for m in range(1, 5)]
        # m drafts' expected accepted tokens against their cost beyond a plain step, priced at
        # the realized rate
        gains = [brute_tokens(a) - 1 - rate * (costs.round_cost(len(a)) - 1) for a in rounds]
        if min(abs(x) for x in gains) > 1e-6:  # (a round exactly at the bar is either's)
            assert pol._pays([True]) == any(x > 0 for x in gains)


def _hold(pol) -> None:
    """Run a call until the floor holds (plain steps with a probe still some steps away)."""
    pol.start(1)
    pol.first, pol.follow = [0.01], [0.01]
    assert pol.plan(4, [True]).k == 0
    pol.observe_step([True])
    assert pol.plan(4, [True]).k == 0
    assert 0 < pol.skipped < pol.interval


@pytest.mark.parametrize("lifetime_pays", [True, False])
def test_a_new_call_ends_a_carried_hold_only_where_drafting_pays(lifetime_pays):
    """The hold (and its step count) carries from call to call, so a drafter that never pays
    probes once per interval however short the decodes; a new call whose starting averages (the
    lifetime's) say drafting pays drafts from its first round instead."""
    costs = DraftCosts(c=0.2, verify_per_token=0.05, round_overhead=0.05)
    pol = make_policy("confidence", 4, 4, costs, probe_every=8)
    acc = 0.9 if lifetime_pays else 0.05
    pol._life["first"] = [1000 * acc, 1000.0]
    pol._life["follow"] = [1000 * acc, 1000.0]
    _hold(pol)
    skipped = pol.skipped
    pol.start(1)
    plan = pol.plan(4, [True])
    if lifetime_pays:
        assert plan.k > 0 and not plan.probe
    else:
        assert plan.k == 0 and pol.skipped == skipped + 1


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
def test_a_decode_that_never_drafts_never_builds_the_drafter_s_cache(drafting):
    """The floor's plain steps cost what target-only steps do: the drafter's prompt is read at
    its first round (lazy prefill), and its runner (cache and all) is built then too; a decode
    that drafts builds one, and stays the target's greedy output either way."""
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    drafter = truncated_copy(target)
    for costs, built in ((DraftCosts(c=5.0), 0), (DraftCosts(c=0.1), 1)):
        cfg = DecoderConfig(
            max_new_tokens=10,
            draft_length="confidence",
            max_draft=3,
            probe_every=32,  # no probe inside one decode
            draft_costs=costs,
            drafting=drafting,
            mask_token_id=63 if drafting == "parallel" else None,
        )
        dec = SpeculativeDecoder(target, drafter, cfg)
        calls = []
        make = dec.drafting.make_runner
        dec.drafting.make_runner = lambda slots, calls=calls, make=make: (
            calls.append(slots) or make(slots)
        )
        prompt = prompts(1, 64, seed=4)[0]
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 10)
        assert len(calls) == built
        assert (out.drafter_forwards > 0) == bool(built)
