"""The floor's decision, and a hold carried from one call into the next.

p = target, q = drafter. Before a round the floor (`DraftLengthPolicy._pays`) weighs a plain
target step against rounds of m >= 1 drafts at the rows' running acceptance: some m must yield
more tokens than the throughput already realized (`rate`, at least a plain step's one token a
step) buys with its extra cost. These tests check it against brute force (every accept/reject
outcome of a round enumerated), the same brute force at the most hopeful acceptances the
lifetime's verdicts allow (`_could_pay`, which decides whether a losing probe climbs the backoff
ladder or jumps to its top), that a hold carried over from the previous call ends when this
call's starting averages say drafting pays, and that a decode that never drafts never builds the
drafter's cache.
"""

from __future__ import annotations

import itertools
import math

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


def _random_policy(g: torch.Generator, parallel: bool, scale: float, batch: int):
    """A started confidence policy (4 drafts at most) on random costs below `scale`."""
    c, per_token, overhead = (scale * torch.rand(3, generator=g)).tolist()
    costs = DraftCosts(c=c, verify_per_token=per_token, round_overhead=overhead, parallel=parallel)
    pol = make_policy("confidence", 4, 4, costs)
    pol.start(batch)
    return pol, costs


def _gains(rounds: list[list[float]], rate: float, costs: DraftCosts) -> list[float]:
    """Each round's expected accepted tokens against its cost beyond a plain step, priced at
    `rate` (rounds[m - 1]: the acceptances of its m drafts)."""
    return [brute_tokens(a) - 1 - rate * (costs.round_cost(len(a)) - 1) for a in rounds]


@pytest.mark.parametrize("parallel", [False, True])
def test_the_floor_drafts_where_some_round_beats_the_realized_rate(parallel):
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        pol, costs = _random_policy(g, parallel, 0.6, 1)
        pol.first = [float(torch.rand(1, generator=g))]
        pol.follow = [float(torch.rand(1, generator=g))]
        pol.later = [torch.rand(3, generator=g).tolist()]
        realized = 0.5 + float(torch.rand(1, generator=g))  # 0.5-1.5 (below 1 the bar is 1)
        pol.tokens, pol.cost = [5.0 * realized], [5.0]
        rate = max(1.0, realized)
        later = pol.later[0] if parallel else [pol.follow[0]] * 3
        rounds = [[pol.first[0], *later[: m - 1]] for m in range(1, 5)]
        gains = _gains(rounds, rate, costs)  # priced at the realized rate
        if min(abs(x) for x in gains) > 1e-6:  # (a round exactly at the bar is either's)
            assert pol._pays([True]) == any(x > 0 for x in gains)


def hoeffding(hits_seen: list[float], fallback: float, doubt: float) -> float:
    """The mean of verdicts in [0, 1] plus Hoeffding's one-sided width at level doubt, at most
    1 (`fallback` without verdicts)."""
    hits, seen = hits_seen
    if seen == 0:
        return fallback
    return min(1.0, hits / seen + math.sqrt(math.log(1 / doubt) / (2 * seen)))


@pytest.mark.parametrize("parallel", [False, True])
def test_could_pay_is_the_floor_at_hoeffding_bounds_of_the_lifetime(parallel):
    """Each acceptance at its verdicts' mean + sqrt(ln(1/doubt) / 2n) (at most 1); a later draft
    without verdicts at the first draft's bound, a parallel depth without them at the depth
    before's; priced by brute force at the realized rate like `_pays`. The rows' running
    averages are left as they were."""
    g = torch.Generator().manual_seed(5)
    decided = 0
    for _ in range(300):
        pol, costs = _random_policy(g, parallel, 0.8, 2)
        counts = []
        for _ in range(2 + len(pol._life_depth)):
            seen = float(torch.randint(0, 200, (1,), generator=g))
            counts.append([seen * float(torch.rand(1, generator=g)), seen])
        pol._life["first"], pol._life["follow"] = counts[0], counts[1]
        pol._life_depth = counts[2:]
        running = ([0.3, 0.2], [0.4, 0.1], [list(r) for r in pol.later])
        pol.first, pol.follow = list(running[0]), list(running[1])
        realized = 0.5 + float(torch.rand(1, generator=g))
        pol.tokens, pol.cost = [5.0 * realized] * 2, [5.0] * 2
        rate = max(1.0, realized)
        first = hoeffding(counts[0], 1.0, pol.doubt)
        follow = hoeffding(counts[1], first, pol.doubt)
        depths, before = [], first
        for d in counts[2:]:
            before = hoeffding(d, before, pol.doubt)
            depths.append(before)
        later = depths if parallel else [follow] * 3
        rounds = [[first, *later[: m - 1]] for m in range(1, 5)]
        gains = _gains(rounds, rate, costs)
        if min(abs(x) for x in gains) > 1e-6:
            assert pol._could_pay([True, False]) == any(x > 0 for x in gains)
            decided += not any(x > 0 for x in gains)
        assert (pol.first, pol.follow, pol.later) == running
    assert decided > 10  # some cases are ruled out, not all


def _losing_probe(pol, acceptance: float, verdicts: int) -> None:
    """A probe round after `verdicts` skipped steps whose shadow verdicts are all
    `acceptance`, its one draft rejected: the floor judges it on the averages."""
    assert pol.plan(4, [True]).probe
    pol.observe_shadow([[acceptance] * verdicts], [True], pairs=False, block=True)
    pol.observe([1], [0], [True], [[0.5]])


@pytest.mark.parametrize(("acceptance", "jumps"), [(0.1, True), (0.55, False)])
def test_a_losing_probe_jumps_to_the_longest_interval_only_where_the_evidence_rules_out(
    acceptance, jumps
):
    """Where a round pays from an acceptance of about 0.62 (two drafts: 1 + a + a^2 = 2 target
    steps): 40 verdicts at 0.1 rule drafting out (the interval goes to max_backoff *
    probe_every at once); at 0.55 they do not (the bound lies above break-even), and the
    interval doubles as before."""
    costs = DraftCosts(c=0.3, verify_per_token=0.05, round_overhead=0.3)
    pol = make_policy("confidence", 4, 4, costs, probe_every=8)
    pol.start(1)
    pol.first, pol.follow = [0.01], [0.01]
    assert pol.plan(4, [True]).k == 0
    for _ in range(pol.interval - 1):
        pol.observe_step([True])
        assert pol.plan(4, [True]).k == 0
    pol.observe_step([True])
    _losing_probe(pol, acceptance, 40)
    longest = pol.max_backoff * pol.probe_every
    assert pol.interval == (longest if jumps else 16)


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


@pytest.mark.parametrize("parallel", [False, True])
def test_a_pending_prefill_must_be_repaid_by_the_tokens_left(parallel):
    """While the drafter has not read the prompt (`pending` target steps), drafting must win
    back that prefill over the decode's `left` tokens: the best round's gain over a plain step
    (brute force, priced at the realized rate) times the rounds left (left / that round's
    expected tokens) against the prefill at that rate. Nothing pending: `_pays` alone."""
    g = torch.Generator().manual_seed(11)
    outcomes = set()
    for _ in range(400):
        pol, costs = _random_policy(g, parallel, 0.6, 1)
        pol.first = [float(torch.rand(1, generator=g))]
        pol.follow = [float(torch.rand(1, generator=g))]
        pol.later = [torch.rand(3, generator=g).tolist()]
        realized = 0.5 + float(torch.rand(1, generator=g))
        pol.tokens, pol.cost = [5.0 * realized], [5.0]
        rate = max(1.0, realized)
        pol.pending = 4.0 * float(torch.rand(1, generator=g))
        pol.left = int(torch.randint(1, 64, (1,), generator=g))
        later = pol.later[0] if parallel else [pol.follow[0]] * 3
        rounds = [[pol.first[0], *later[: m - 1]] for m in range(1, 5)]
        gains = _gains(rounds, rate, costs)
        best = max(range(4), key=gains.__getitem__)
        margin = gains[best] * pol.left / brute_tokens(rounds[best]) - rate * pol.pending
        if gains[best] > 1e-6 and abs(margin) > 1e-6:
            want = margin > 0
            assert pol._prefill_pays([True]) == want
            outcomes.add(want)
        elif gains[best] < -1e-6:
            assert not pol._prefill_pays([True])
        pol.pending = 0.0
        assert pol._prefill_pays([True])
    assert outcomes == {True, False}


def test_a_decode_holds_until_drafting_repays_the_drafter_s_prefill():
    """A drafter that pays a little a round: with its prefill pending and few tokens left the
    floor takes plain steps (and a due probe waits), with many left it drafts; once the drafter
    has read the prompt (pending 0) the same averages draft at once."""
    costs = DraftCosts(c=0.2, verify_per_token=0.05, round_overhead=0.05)
    pol = make_policy("confidence", 4, 4, costs, probe_every=8)
    pol.start(1)
    pol.first, pol.follow = [0.6], [0.6]
    assert pol._pays([True])
    pol.pending, pol.left = 3.0, 4
    assert pol.plan(4, [True]).k == 0 and pol.skipped == 1
    pol.skipped = pol.interval  # a probe is due: it waits too, the interval starts over
    plan = pol.plan(4, [True])
    assert plan.k == 0 and not plan.probe and pol.skipped == 1
    pol.skipped, pol.left = 0, 400
    assert pol.plan(4, [True]).k > 0
    pol.pending, pol.left = 0.0, 4
    assert pol.plan(4, [True]).k > 0


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
def test_a_dear_prefill_keeps_a_short_decode_on_the_target_s_steps(drafting):
    """Decoding with a drafter that pays a round but whose prefill the decode's tokens cannot
    repay: plain target steps only, the drafter never built, the target's greedy output; with
    the prefill cheap, the same decode drafts and `pending` is 0 after its first round."""
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    drafter = truncated_copy(target)
    # dear per token, dear per call (a short prompt's prefill is mostly its fixed part), cheap
    for per_token, fixed, drafts in ((50.0, 0.0, False), (0.001, 90.0, False), (0.001, 0.0, True)):
        costs = DraftCosts(c=0.1, prefill_per_token=per_token, prefill_fixed=fixed)
        cfg = DecoderConfig(
            max_new_tokens=10,
            draft_length="confidence",
            max_draft=3,
            probe_every=2,
            draft_costs=costs,
            drafting=drafting,
            mask_token_id=63 if drafting == "parallel" else None,
        )
        dec = SpeculativeDecoder(target, drafter, cfg)
        prompt = prompts(1, 64, seed=4)[0]
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 10)
        assert (out.drafter_forwards > 0) == drafts
        pending = 0.0 if drafts else costs.prefill_cost(len(prompt) - 1)
        assert dec.get_policy().pending == pytest.approx(pending)


def test_the_realized_rate_counts_lookup_rounds_and_starts_from_the_lifetime():
    """`rate`, the throughput a drafting round must beat: a lookup round adds its tokens for its
    modeled verify (no drafter forward); a new call starts as if `rate_prior_steps` steps had
    gone at the lifetime's finished calls' rate (a step at 1 before any), never below 1."""
    costs = DraftCosts(c=0.3, verify_per_token=0.1, round_overhead=0.2)
    pol = make_policy("confidence", 4, 4, costs)
    pol.start(1)
    assert (pol.tokens, pol.cost) == ([1.0], [1.0])
    pol.observe_lookup(3, 2, [True])  # 3 drafts, 2 kept: 3 tokens for a verify of 3
    pol.observe_step([True])
    pol.observe_lookup(2, 2, [False])  # a finished row learns nothing
    assert pol.tokens == [1.0 + 3 + 1]
    assert pol.cost == [pytest.approx(1.0 + costs.verify_cost(3) + 1)]
    life_rate = 4.0 / (costs.verify_cost(3) + 1)  # the call's own rounds, its prior apart
    pol.start(2)
    steps = pol.rate_prior_steps
    assert pol.cost == [steps, steps]
    assert pol.tokens == [pytest.approx(steps * life_rate)] * 2
    assert pol.rate(0) == pytest.approx(life_rate)
    for _ in range(4):  # plain steps only: the lifetime's rate falls towards 1, not below
        pol.observe_step([True, True])
    pol.start(1)
    total_t = 4.0 + 2 * 4  # both calls' own tokens, the second's two rows
    total_c = costs.verify_cost(3) + 1 + 2 * 4
    assert pol.rate(0) == pytest.approx(total_t / total_c)
    slow = make_policy("confidence", 4, 4, costs)
    slow.start(1)
    slow.observe(lengths=[4], accepted=[0], active=[True], conf=None)  # 1 token for a round
    slow.start(1)
    assert slow.rate(0) == 1.0 and slow.tokens == [slow.rate_prior_steps]


def test_a_decode_s_rate_counts_every_token_whatever_round_emitted_it():
    """Greedy decodes with prompt lookup (outputs that repeat their prompt): the policy's
    realized tokens are exactly the tokens emitted, lookup rounds' included, and lookup rounds
    ran."""
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    cfg = DecoderConfig(
        max_new_tokens=24,
        draft_length="confidence",
        max_draft=3,
        lookup=True,
        draft_costs=DraftCosts(c=0.2, verify_per_token=0.02, round_overhead=0.05),
    )
    dec = SpeculativeDecoder(target, truncated_copy(target), cfg)
    prompt = prompts(1, 64, seed=4)[0]
    prompt = prompt + prompt + prompt
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    pol = dec.get_policy()
    assert out.lookup_rounds > 0
    assert pol.tokens[0] - 1.0 == len(out.tokens[0])  # the first call's prior: one step at 1
