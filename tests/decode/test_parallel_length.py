"""Adaptive draft lengths with parallel drafting (decode.drafters.parallel + decode.draft_length).

p = target, q = drafter. A parallel round proposes k drafts in one forward; `confidence` then
verifies the prefix whose calibrated expected tokens best pay for the verify, `heuristic`
changes k round by round, and both may replace a round by a plain target step (the floor).
The choice reads q only, so greedy output stays token-identical to the target's and sampled
output follows the target's law (chi-square on a small vocabulary).
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.decode.draft_length import (
    ConfidenceLength,
    DraftCosts,
    expected_tokens,
)
from specdistill.decode.draft_length.policies import DraftLengthPolicy
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.decode.test_distribution import chi2_pvalue, exact_sequence_probs
from tests.decode.test_distribution import models as models
from tests.decode.test_draft_length import _sample
from tests.decode.test_parallel import MASK
from tests.decode.test_parallel import pair as pair
from tests.decode.test_speculative import greedy_reference, left_pad, prompts

PAR = DraftCosts(c=0.3, verify_per_token=0.15, round_overhead=0.05, parallel=True)
DEAR = DraftCosts(c=0.9, verify_per_token=0.2, round_overhead=0.3, parallel=True)  # floor
# every verify width timed (decoder.verify_costs=by_width): 3 drafts cheaper than 2, 5 than 4
WIDTHS = DraftCosts(
    c=0.3,
    verify_per_token=0.15,
    round_overhead=0.05,
    parallel=True,
    verify_tokens=(0.15, 0.45, 0.3, 0.8, 0.6),
)


def _calibrated(weights: list[list[float]], costs: DraftCosts, scope: str, b: int):
    pol = ConfidenceLength(4, len(weights), costs, scope=scope)
    for cal, w in zip(pol.depth, weights):
        cal.w = torch.tensor(w, dtype=torch.float64)
        cal._wf = list(w)
    pol.start(b)
    pol.plan(len(weights), [True] * b)
    return pol


@pytest.mark.parametrize("scope", ["batch", "row"])
@pytest.mark.parametrize("rate", [1.0, 1.6, 3.0])
@pytest.mark.parametrize("costs", [PAR, WIDTHS], ids=["line", "by_width"])
def test_verify_lengths_is_the_argmax_over_every_prefix(scope, rate, costs):
    """Against enumeration: the verified prefix maximises E_L - rate * cost(L), L >= 1, with
    each depth's calibrated acceptance (batch scope: the rows' summed objective)."""
    gen = torch.Generator().manual_seed(0)
    weights = [[0.5, 1.0, 0.0], [-0.5, 0.8, 0.0], [-1.0, 1.2, 0.0], [0.0, 0.5, 0.0]]
    for trial in range(20):
        b = 3
        pol = _calibrated(weights, costs, scope, b)
        pol.tokens, pol.cost = [rate] * b, [1.0] * b  # realized throughput = rate
        conf = torch.rand(b, 4, generator=gen).tolist()
        active = [True, trial % 3 != 0, True]
        got = pol.verify_lengths(conf, active)

        def value(r: int, length: int, pol=pol, conf=conf) -> float:
            acc = [pol.depth[j](conf[r][j], pol.r0[r]) for j in range(length)]
            return expected_tokens(acc) - rate * costs.round_cost(length)

        if scope == "row":
            for r in range(b):
                if active[r]:
                    best = max(range(1, 5), key=lambda n, r=r: value(r, n))
                    assert got[r] == best
        else:
            best = max(range(1, 5), key=lambda n: sum(value(r, n) for r in range(b) if active[r]))
            assert got == [best] * b


def test_depth_calibrations_learn_from_the_drafts_put_to_the_test():
    """Depth 1 always accepted, depth 2 always rejected: the policy goes from verifying two
    drafts (prior: ~0.55 each) to one; depth 3 is never reached, so it keeps its prior (depth
    2's fit)."""
    costs = DraftCosts(c=0.3, verify_per_token=0.2, round_overhead=0.05, parallel=True)
    pol = ConfidenceLength(4, 3, costs, scope="batch")
    pol.start(2)
    pol.plan(3, [True, True])
    conf = [[0.6, 0.6, 0.6], [0.5, 0.7, 0.4]]
    assert pol.verify_lengths(conf, [True, True]) == [2, 2]
    for _ in range(200):
        pol.plan(3, [True, True])
        pol.observe([3, 3], [1, 1], [True, True], conf)
    assert pol.depth[0](0.6, 0.5) > 0.9
    assert pol.depth[1](0.6, 0.5) < 0.1
    torch.testing.assert_close(pol.depth[2].w0, pol.depth[1].w)
    assert len(pol.depth[2].y) == 0
    pol.plan(3, [True, True])
    assert pol.verify_lengths(conf, [True, True]) == [1, 1]


def _cfg(policy: str, costs: DraftCosts, **kw) -> DecoderConfig:
    return DecoderConfig(
        drafting="parallel",
        mask_token_id=MASK,
        draft_length=policy,
        draft_costs=costs,
        probe_every=2,
        **kw,
    )


@pytest.mark.parametrize("policy", ["confidence", "heuristic"])
@pytest.mark.parametrize("costs", [PAR, DEAR, WIDTHS], ids=["cheap", "dear", "by_width"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_parallel_adaptive_greedy_is_token_identical_batch1(pair, policy, costs, cache):
    target, drafter = pair
    dec = SpeculativeDecoder(
        target, drafter, _cfg(policy, costs, max_draft=5, max_new_tokens=24, cache=cache)
    )
    lengths = [0] * 6
    for prompt in prompts(4, 8, seed=2):
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        assert out.drafter_forwards == out.target_forwards - out.draft_lengths[0]
        lengths = [a + b for a, b in zip(lengths, out.draft_lengths)]
    assert sum(1 for n in lengths[1:] if n) >= 2  # verified lengths really varied
    if costs is DEAR:
        assert lengths[0] > 0 and sum(lengths[1:]) > 0  # plain target steps and probes


@pytest.mark.parametrize("scope", ["batch", "row"])
def test_parallel_confidence_up_to_15_drafts_is_token_identical(pair, scope):
    """Deep rounds: one forward proposes up to 15 drafts, `confidence` picks how many to verify."""
    target, drafter = pair
    cfg = _cfg("confidence", PAR, max_draft=15, max_new_tokens=40, draft_scope=scope)
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(4, 8, seed=9)
    ids, mask = left_pad(rows)
    for _ in range(2):  # the second call starts from a fitted calibration
        out = dec.generate(ids, mask)
        assert out.tokens == [greedy_reference(target, r, 40) for r in rows]
        assert len(out.draft_lengths) == 16 and 0 < out.accepted < out.trials


@pytest.mark.parametrize("policy", ["confidence", "heuristic", "fixed"])
def test_adaptive_rounds_stop_at_the_depth_the_drafter_was_trained_for(pair, policy):
    """A drafter whose config.json says it was trained for 2 drafts a round
    (`parallel_drafting.max_drafts`, as distill writes it): adaptive rounds propose and verify
    at most 2 however large max_draft is; a fixed gamma stays the user's; output stays the
    target's greedy."""
    target, drafter = pair
    trained = copy.deepcopy(drafter)
    trained.config.parallel_drafting = {"mask_token_id": MASK, "max_drafts": 2}
    cfg = _cfg(policy, PAR, max_draft=8, gamma=4, max_new_tokens=24)
    dec = SpeculativeDecoder(target, trained, cfg)
    assert dec.max_draft == (4 if policy == "fixed" else 2)
    for prompt in prompts(3, 8, seed=4):
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        assert len(out.draft_lengths) == dec.max_draft + 1
    assert SpeculativeDecoder(target, drafter, cfg).max_draft == (4 if policy == "fixed" else 8)


@pytest.mark.parametrize("policy", ["confidence", "heuristic"])
@pytest.mark.parametrize("scope", ["batch", "row"])
@pytest.mark.parametrize("costs", [PAR, DEAR], ids=["cheap", "dear"])
def test_parallel_adaptive_greedy_batched(pair, policy, scope, costs, monkeypatch):
    target, drafter = pair
    # dear costs rule drafting out after the first losing probe (`_could_pay`); the ladder
    # without that jump keeps probing, so both calls verify parallel drafts in batched rows
    monkeypatch.setattr(DraftLengthPolicy, "doubt", 0.0)
    cfg = _cfg(policy, costs, max_draft=5, max_new_tokens=20, draft_scope=scope, cache="static")
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(5, 8, seed=6)
    ids, mask = left_pad(rows)
    for _ in range(2):  # the second call starts from a fitted calibration
        out = dec.generate(ids, mask)
        assert out.tokens == [greedy_reference(target, r, 20) for r in rows]
        assert sum(out.draft_lengths) == out.row_rounds
        assert 0 < out.accepted < out.trials


@pytest.mark.parametrize(
    ("policy", "scope", "rows", "calls"),
    [
        ("confidence", "batch", 1, 1024),
        ("confidence", "row", 512, 16),
        ("heuristic", "batch", 512, 16),
    ],
)
def test_parallel_adaptive_sampling_matches_target_distribution(models, policy, scope, rows, calls):
    """Exact 3-token sequence law of target-only sampling against the parallel decoder with
    adaptive lengths (row scope: rows verify different prefixes of one forward's proposals)."""
    target, drafter = models  # mask id 3 overlaps p
    s = Sampling(1.0)
    cfg = DecoderConfig(
        drafting="parallel",
        mask_token_id=3,
        max_new_tokens=3,
        sampling=s,
        draft_length=policy,
        draft_scope=scope,
        max_draft=3,
        probe_every=1,
        draft_costs=DraftCosts(c=0.3, verify_per_token=0.1, round_overhead=0.1),
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    counts, lengths = _sample(dec, rows, calls, seed=33)
    assert chi2_pvalue(exact_sequence_probs(target, s), counts, rows * calls) > 1e-3
    assert sum(1 for x in lengths[1:] if x) >= 2, lengths  # verified lengths really varied


def test_configured_costs_take_the_drafting_mode(pair):
    target, drafter = pair
    plain = DraftCosts(c=0.3, verify_per_token=0.1, round_overhead=0.1)
    dec = SpeculativeDecoder(target, drafter, _cfg("confidence", plain))
    assert dec.draft_costs().parallel
    assert dec.draft_costs().round_cost(4) == pytest.approx(0.3 + 1 + 0.1 + 0.4)


def test_a_parallel_forward_costs_more_with_more_proposals():
    costs = DraftCosts(
        c=0.3, verify_per_token=0.1, round_overhead=0.05, parallel=True, draft_per_token=0.02
    )
    assert costs.round_cost(1) == pytest.approx(0.3 + 1 + 0.05 + 0.1)
    assert costs.round_cost(5) == pytest.approx(0.3 + 4 * 0.02 + 1 + 0.05 + 0.5)
    plain = DraftCosts(c=0.3, verify_per_token=0.1, round_overhead=0.05, draft_per_token=0.02)
    assert plain.round_cost(5) == pytest.approx(5 * 0.3 + 1 + 0.05 + 0.5)  # autoregressive


@pytest.mark.parametrize(
    ("first", "follow", "want"), [(0.98, 0.95, 8), (0.6, 0.4, 4), (0.1, 0.1, 2)]
)
def test_parallel_proposals_follow_the_running_acceptance(first, follow, want):
    """The forward proposes the running averages' best m plus 2 spares (capped at max_draft):
    many when drafts have been accepted, the spares alone when none pays (no floor here)."""
    costs = DraftCosts(
        c=0.4, verify_per_token=0.1, round_overhead=0.05, parallel=True, draft_per_token=0.02
    )
    pol = ConfidenceLength(4, 8, costs, scope="batch", floor=False)
    pol.start(1)
    pol.first, pol.later = [first], [[follow] * 7]
    best = max(
        range(0, 9),
        key=lambda m: (
            0.0
            if m == 0
            else expected_tokens([first] + [follow] * (m - 1)) - 1 - (costs.round_cost(m) - 1)
        ),
    )
    assert pol.plan(8, [True]).k == min(8, max(1, best + 2)) == want


def test_the_floor_probes_again_across_short_decodes():
    """A backed-off probe interval longer than one decode: the count of plain target steps
    carries from call to call, so a probe still comes."""
    costs = DraftCosts(c=0.9, verify_per_token=0.2, round_overhead=0.3, parallel=True)
    pol = ConfidenceLength(4, 4, costs, scope="batch", probe_every=8)
    pol.interval = 32
    probes = 0
    for _call in range(12):  # 12 decodes of 10 tokens: probes after 32, then 64 more steps
        pol.start(1)
        pol.first, pol.later = [0.1], [[0.1] * 3]
        for _ in range(10):
            plan = pol.plan(4, [True])
            if plan.k == 0:
                pol.observe_step([True])
            else:
                probes += plan.probe
                pol.observe([1], [0], [True], [[0.5]])
    assert probes >= 2


def _walk_by_enumeration(first: float, later: list[float], m: int) -> float:
    """Expected accepted drafts of an m-draft parallel round, every accept/reject outcome of
    its m drafts enumerated (draft d accepted w.p. its depth's rate; a draft after a rejection
    is never kept)."""
    import itertools

    rates = [first, *later][:m]
    total = 0.0
    for outcome in itertools.product((0, 1), repeat=m):
        prob = 1.0
        for ok, a in zip(outcome, rates):
            prob *= a if ok else 1.0 - a
        kept = next((j for j, ok in enumerate(outcome) if not ok), m)
        total += prob * kept
    return total


@pytest.mark.parametrize("scope", ["batch", "row"])
def test_the_floor_prices_a_parallel_round_depth_by_depth(scope):
    """Before the forward, a parallel round of m drafts is priced with each depth's own running
    acceptance: the expected accepted drafts equal exact enumeration, and the count the floor
    and the forward plan is the argmax of E - rate * cost over m by brute force (timed verify
    widths: 3 drafts cheaper than 2)."""
    costs = DraftCosts(
        c=0.2, verify_per_token=0.07, round_overhead=0.2, parallel=True, draft_per_token=0.02,
        verify_tokens=(0.07, 0.28, 0.06, 0.27),
    )  # fmt: skip
    for first, later, rate in [
        ((0.5, [0.45, 0.35, 0.1], 1.25)),
        ((0.9, [0.8, 0.7, 0.6], 1.5)),
        ((0.3, [0.2, 0.1, 0.1], 1.1)),
        ((0.6, [0.1, 0.9, 0.9], 1.0)),
        ((0.95, [0.95, 0.95, 0.95], 1.0)),
        ((0.7, [0.02, 0.5, 0.5], 1.0)),
    ]:
        pol = ConfidenceLength(4, 4, costs, scope=scope)
        pol.start(1)
        pol.first, pol.later = [first], [list(later)]
        walk = pol._accepted_by_length(0)
        for m in range(1, 5):
            assert walk[m - 1] == pytest.approx(_walk_by_enumeration(first, later, m))
        pol.tokens, pol.cost = [rate], [1.0]  # the realized rate to beat
        gains = [0.0] + [
            _walk_by_enumeration(first, later, m) - rate * (costs.round_cost(m) - 1)
            for m in range(1, 5)
        ]
        want = max(range(5), key=gains.__getitem__)
        assert pol._best_m([True]) == want, (first, later, gains)
        plan = pol.plan(4, [True])
        assert plan.k == (min(4, want + pol.spare) if want else 0)  # 0: the floor's plain step


def test_parallel_depths_learn_from_the_drafts_put_to_the_test():
    """Each depth's average moves only with drafts tested at that depth (the ones whose
    predecessors were all accepted); the next call starts from lifetime counts, a depth never
    tested from the depth before's start."""
    pol = ConfidenceLength(4, 4, PAR, scope="batch", floor=False)
    pol.start(2)
    assert pol.later == [[0.5, 0.5, 0.5]] * 2
    fe = pol.floor_ema
    pol.plan(4, [True, True])
    # row 0 verified 3 and kept 1 (depth 2 rejected); row 1 verified 3 and kept all
    pol.observe([3, 3], [1, 3], [True, True], [[0.9, 0.5, 0.5], [0.9, 0.5, 0.5]])
    assert pol.later[0] == pytest.approx([0.5 * (1 - fe), 0.5, 0.5])
    assert pol.later[1] == pytest.approx([0.5 * (1 - fe) + fe, 0.5 * (1 - fe) + fe, 0.5])
    assert pol._life_depth == [[1.0, 2], [1.0, 1], [0.0, 0]]
    pol.start(1)
    d2 = (1.0 + 2 * pol._prior("first")) / 4
    d3 = (1.0 + 2 * d2) / 3
    assert pol.later[0] == pytest.approx([d2, d3, d3])
