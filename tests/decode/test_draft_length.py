"""Per-round draft length (decode.draft_length): the expected-gain rule against brute force, and
the adaptive decoder's losslessness (greedy token-identical, sampling by chi-square).

p = target, q = drafter. The stopping rule may read q and earlier rounds only; these tests show
that whatever length it picks, greedy output is the target's and sampled output follows p.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import verify_sampling
from specdistill.decode.draft_length import (
    Calibration,
    DraftCosts,
    best_length,
    best_more,
    chunk_widths,
    draft_gain,
    expected_tokens,
    make_policy,
    replay,
    verify_widths,
)
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_distribution import (
    PROMPT,
    chi2_pvalue,
    exact_sequence_probs,
    models,  # noqa: F401  (fixture)
)
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy

# ---------------------------------------------------------------- the rule, by enumeration


def brute_tokens(accept: list[float]) -> float:
    """E[tokens] of a round by enumerating every accept/reject outcome of its drafts."""
    total = 0.0
    for outcome in itertools.product([0, 1], repeat=len(accept)):
        prob = 1.0
        for a, o in zip(accept, outcome):
            prob *= a if o else 1 - a
        n = next((j for j, o in enumerate(outcome) if not o), len(accept))  # accepted prefix
        total += prob * (n + 1)
    return total


@pytest.mark.parametrize("accept", [[], [0.3], [0.9, 0.5], [0.2, 0.8, 0.6, 1.0], [0.7] * 5])
def test_expected_tokens_matches_enumeration(accept):
    assert expected_tokens(accept) == pytest.approx(brute_tokens(accept), abs=1e-12)


COSTS = [
    DraftCosts(c=0.38, verify_per_token=0.06, round_overhead=0.15),
    DraftCosts(c=0.05, verify_per_token=0.0, round_overhead=0.0),
    DraftCosts(c=0.9, verify_per_token=0.2, round_overhead=0.4),
    DraftCosts(c=0.3, verify_per_token=0.05, round_overhead=0.1, parallel=True),
    # every verify width timed (decoder.verify_costs=by_width): uneven, shorter than max_k
    DraftCosts(
        c=0.2, verify_per_token=0.1, round_overhead=0.0, verify_tokens=(0.1, 0.4, 0.15, 0.5)
    ),
    # the round's host glue timed (draft_length.measure.round_glue): a part per draft
    DraftCosts(c=0.35, verify_per_token=0.07, round_overhead=0.01, glue_per_draft=0.06),
]
IDS = ["toy", "cheap", "dear", "parallel", "by_width", "glue"]


def test_round_cost_by_hand():
    """k drafts: k c (one forward for a parallel drafter, plus a mask per further proposal) +
    k glue_per_draft + 1 + round_overhead + the verify's k positions (its table where timed)."""
    glue = DraftCosts(c=0.35, verify_per_token=0.07, round_overhead=0.01, glue_per_draft=0.06)
    assert glue.round_cost(0) == 1.0
    assert glue.round_cost(3) == pytest.approx(3 * 0.35 + 3 * 0.06 + 1 + 0.01 + 3 * 0.07)
    par = DraftCosts(
        c=0.3, round_overhead=0.0, parallel=True, draft_per_token=0.02, glue_per_draft=0.05,
        verify_tokens=(0.1, 0.3),
    )  # fmt: skip
    assert par.round_cost(2) == pytest.approx(0.3 + 0.02 + 2 * 0.05 + 1 + 0.3)
    assert par.round_cost(3) == pytest.approx(0.3 + 2 * 0.02 + 3 * 0.05 + 1 + 3 * 0.05)


@pytest.mark.parametrize("costs", COSTS, ids=IDS)
@pytest.mark.parametrize("drafted", [0, 1, 3])
@pytest.mark.parametrize("rate", [1.0, 1.7])
@pytest.mark.parametrize("first", [None, [0.4, 0.9, 0.05]])
def test_draft_gain_matches_enumeration(costs, drafted, rate, first):
    """Net gain of m more drafts (tokens - rate * extra cost) for rows of known history: the
    closed form against enumerating every outcome of the whole round (the next draft accepted
    with probability `first`, each later one with `nxt`)."""
    history = [[0.9, 0.6, 0.7], [0.3, 0.95, 0.5], [1.0, 1.0, 0.2]]
    nxt = torch.tensor([0.8, 0.35, 0.99], dtype=torch.float64)
    max_k = 6
    prefix = torch.tensor([math.prod(h[:drafted]) for h in history], dtype=torch.float64)
    got = draft_gain(
        prefix,
        nxt,
        drafted,
        max_k,
        costs,
        torch.full((3,), rate, dtype=torch.float64),
        first_accept=None if first is None else torch.tensor(first, dtype=torch.float64),
    )
    assert got.shape == (3, max_k - drafted + 1)
    for r, h in enumerate(history):
        stop_now = brute_tokens(h[:drafted]) - rate * costs.round_cost(drafted)
        for m in range(max_k - drafted + 1):
            a1 = float(nxt[r]) if first is None else first[r]
            plan = h[:drafted] + ([a1] + [float(nxt[r])] * (m - 1) if m else [])
            want = brute_tokens(plan) - rate * costs.round_cost(drafted + m) - stop_now
            assert float(got[r, m]) == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("costs", COSTS, ids=IDS)
def test_scalar_rule_agrees_with_draft_gain(costs):
    """`best_more` (plain floats, what the decoder runs per drafter step) picks draft_gain's
    argmax and value."""
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        prefix, first, nxt, rate = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        rate, drafted = 1 + rate, int(torch.randint(0, 5, (1,), generator=g))
        inc = [costs.round_cost(drafted + i) - costs.round_cost(drafted) for i in range(1, 7)]
        m, v = best_more(prefix, first, nxt, inc, rate)
        gains = draft_gain(
            torch.tensor([prefix], dtype=torch.float64),
            torch.tensor([nxt], dtype=torch.float64),
            drafted,
            drafted + 6,
            costs,
            torch.tensor([rate], dtype=torch.float64),
            first_accept=torch.tensor([first], dtype=torch.float64),
        )[0]
        assert v == pytest.approx(float(gains.max()), abs=1e-9)
        assert float(gains[m]) == pytest.approx(float(gains.max()), abs=1e-9)


@pytest.mark.parametrize("costs", COSTS, ids=IDS)
def test_best_length_is_the_argmax_over_all_lengths(costs):
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        accept = torch.rand(6, generator=g).tolist()
        k = best_length(accept, costs)
        values = [brute_tokens(accept[:j]) - costs.round_cost(j) for j in range(7)]
        assert values[k] == pytest.approx(max(values), abs=1e-9)


def test_floor_threshold_is_where_one_draft_pays():
    """Before a round (nothing drafted), drafting pays iff some m >= 1 has a positive gain; for
    m = 1 that is acceptance > c + verify_per_token + round_overhead (at rate 1)."""
    costs = DraftCosts(c=0.4, verify_per_token=0.05, round_overhead=0.15)
    edge = 0.6
    low, high = torch.tensor([edge - 0.01]), torch.tensor([edge + 0.01])
    one = torch.ones(1)
    assert float(draft_gain(one, low, 0, 1, costs, one)[0, 1]) < 0
    assert float(draft_gain(one, high, 0, 1, costs, one)[0, 1]) > 0


def test_calibration_fit_is_the_penalised_maximum_likelihood():
    """The damped Newton fit against a general-purpose minimiser of the same objective, on a
    drafter whose flat probabilities mean high acceptance (what the toy drafters look like)."""
    from scipy.optimize import minimize

    g = torch.Generator().manual_seed(0)
    conf = 0.02 + 0.06 * torch.rand(400, generator=g, dtype=torch.float64)
    recent = 0.3 + 0.6 * torch.rand(400, generator=g, dtype=torch.float64)
    truth = torch.sigmoid(3.0 + 0.8 * torch.logit(conf) + 1.0 * torch.logit(recent))
    accepted = (torch.rand(400, generator=g, dtype=torch.float64) < truth).double()
    cal = Calibration(prior=4.0, refit_every=10**9)
    assert cal(0.9, 0.9) == pytest.approx(0.9)  # the prior
    cal.update(conf.tolist(), recent.tolist(), accepted.tolist())
    cal.fit(steps=50)
    x = np.stack([np.ones(400), np.array(cal.lc), np.array(cal.lr)], 1)
    y, w0 = accepted.numpy(), cal.w0.numpy()

    def objective(w):
        z = x @ w
        return float((np.logaddexp(0, z) - y * z).sum() + 2.0 * ((w - w0) ** 2).sum())

    best = minimize(objective, w0, method="BFGS", options={"gtol": 1e-10})
    assert cal.w.numpy() == pytest.approx(best.x, abs=1e-4)
    assert objective(cal.w.numpy()) <= best.fun + 1e-8
    assert cal(0.05, 0.8) > 0.6  # learnt: flat != poor


def test_compiled_shapes_stay_few():
    assert verify_widths(8) == [1, 2, 3, 5, 9]
    assert verify_widths(6) == [1, 2, 3, 5, 7]
    assert chunk_widths(11) == [8, 2, 1] and chunk_widths(40) == [16, 16, 8]


def test_verify_sampling_lengths_cut_rows():
    """A row that proposed fewer drafts tests only those; with all accepted its next token is
    sampled from p at that position (the bonus), never from a residual."""
    v = 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).repeat(2, 3, 1)
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).repeat(2, 2, 1)
    draft = torch.tensor([[3, 3], [3, 3]])  # p/q = 4 at token 3: always accepted
    u = torch.zeros(2, 2)
    lengths = torch.tensor([1, 2])
    counts = torch.zeros(v)
    for i in range(2000):
        us = torch.tensor([i / 2000, 0.5])
        n, nxt = verify_sampling(draft, p, q, u, us, lengths=lengths)
        assert n.tolist() == [1, 2]
        counts[nxt[0]] += 1
    assert torch.allclose(counts / 2000, p[0, 1], atol=1e-3)  # the bonus follows p


# ---------------------------------------------------------------- the decoder, lossless


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    return target, truncated_copy(target)


CHEAP = DraftCosts(c=0.2, verify_per_token=0.02, round_overhead=0.05)
DEAR = DraftCosts(c=0.9, verify_per_token=0.1, round_overhead=0.3)  # the floor engages
# every verify width timed (decoder.verify_costs=by_width): 3 drafts cheaper than 2
WIDTHS = DraftCosts(
    c=0.1, verify_per_token=0.05, round_overhead=0.0, verify_tokens=(0.05, 0.4, 0.1, 0.5)
)


@pytest.mark.parametrize("policy", ["confidence", "heuristic"])
@pytest.mark.parametrize("costs", [CHEAP, DEAR, WIDTHS], ids=["cheap", "dear", "by_width"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_adaptive_greedy_is_token_identical_batch1(pair, policy, costs, cache):
    target, drafter = pair
    cfg = DecoderConfig(
        max_new_tokens=24,
        draft_length=policy,
        max_draft=6,
        probe_every=3,
        draft_costs=costs,
        cache=cache,
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    lengths = [0] * 7
    for prompt in prompts(4, 64, seed=3):
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        lengths = [a + b for a, b in zip(lengths, out.draft_lengths)]
    assert sum(1 for n in lengths if n) >= 2  # lengths really varied
    if costs is DEAR:  # plain target steps, and probes among them
        assert lengths[0] > 0 and sum(lengths[1:]) > 0


@pytest.mark.parametrize("policy", ["confidence", "heuristic"])
@pytest.mark.parametrize("scope", ["batch", "row"])
@pytest.mark.parametrize("costs", [CHEAP, DEAR], ids=["cheap", "dear"])
def test_adaptive_greedy_batched_uneven_prompts(pair, policy, scope, costs):
    target, drafter = pair
    cfg = DecoderConfig(
        max_new_tokens=20,
        draft_length=policy,
        draft_scope=scope,
        max_draft=5,
        probe_every=2,
        draft_costs=costs,
        cache="static",
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(5, 64, seed=4)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    for r, prompt in enumerate(rows):
        assert out.tokens[r] == greedy_reference(target, prompt, 20)
    assert sum(out.draft_lengths) == out.row_rounds


def test_useless_drafter_decodes_with_the_target_alone(pair):
    """A random drafter never pays: after the first rounds, plain target steps and periodic
    probes only (the floor), at measured costs."""
    target, _ = pair
    drafter = tiny_llama(vocab=64, layers=1, hidden=32, seed=7)
    cfg = DecoderConfig(max_new_tokens=48, draft_length="confidence", probe_every=8)
    dec = SpeculativeDecoder(target, drafter, cfg)
    prompt = prompts(1, 64, seed=5)[0]
    dec.generate(torch.tensor([prompt]))  # measures the costs, learns the acceptance
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 48)
    assert out.draft_lengths[0] >= 0.75 * out.row_rounds
    assert out.drafter_forwards <= 48 // 8 + 2


# ---------------------------------------------------------------- sampling, by chi-square


def _sample(dec, rows: int, calls: int, seed: int):
    """Sequence counts over rows * calls samples, and the draft-length histogram of the run."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT] * rows)
    counts: dict[tuple[int, ...], int] = {}
    lengths: list[int] = []
    for _ in range(calls):
        out = dec.generate(ids, torch.ones_like(ids), generator=gen)
        lengths = [a + b for a, b in itertools.zip_longest(lengths, out.draft_lengths, fillvalue=0)]
        for row in out.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, lengths


@pytest.mark.parametrize(
    ("policy", "scope", "rows", "calls"),
    [
        ("confidence", "batch", 1, 1024),
        ("confidence", "row", 512, 16),
        ("confidence", "batch", 512, 16),
        ("heuristic", "row", 512, 16),
    ],
)
def test_adaptive_sampling_matches_target_distribution(models, policy, scope, rows, calls):  # noqa: F811
    """The exact 3-token sequence law of target-only sampling against the adaptive decoder's
    samples, batch 1 and batched (row scope: rows verify different lengths)."""
    target, drafter = models
    s = Sampling(1.0)
    cfg = DecoderConfig(
        max_new_tokens=3,
        sampling=s,
        draft_length=policy,
        draft_scope=scope,
        max_draft=3,
        probe_every=1,
        draft_costs=DraftCosts(c=0.3, verify_per_token=0.05, round_overhead=0.1),
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    counts, lengths = _sample(dec, rows, calls, seed=21)
    n = rows * calls
    assert chi2_pvalue(exact_sequence_probs(target, s), counts, n) > 1e-3
    assert sum(1 for x in lengths if x) >= 2  # lengths really varied


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"draft_length": "auto"}, "decoder.draft_length"),
        ({"max_draft": 0}, "decoder.max_draft"),
        ({"max_draft": 16}, "decoder.max_draft"),
        ({"draft_scope": "rows"}, "decoder.draft_scope"),
        ({"draft_floor": "yes"}, "decoder.draft_floor"),
        ({"probe_every": 0}, "decoder.probe_every"),
        ({"draft_costs": DraftCosts(c=-1.0)}, "decoder.draft_c"),
        ({"draft_costs": DraftCosts(round_overhead=-0.6)}, "decoder.draft_round_overhead"),
    ],
)
def test_bad_draft_length_settings_name_the_field(kwargs, field):
    target = tiny_llama(vocab=64, layers=1)
    with pytest.raises(ConfigError, match=rf"^{field}="):
        SpeculativeDecoder(target, target, DecoderConfig(**kwargs))


def test_a_verify_cheaper_than_a_target_step_lowers_the_floor():
    """round_overhead < 0 (a 2-token verify that undercuts a 1-token step: CPU GEMM vs GEMV) is
    accepted, and one draft then pays from acceptance c + verify_per_token + round_overhead."""
    target = tiny_llama(vocab=64, layers=1)
    cheap = DraftCosts(c=0.17, verify_per_token=0.0, round_overhead=-0.12)  # edge 0.05
    SpeculativeDecoder(target, target, DecoderConfig(draft_length="confidence", draft_costs=cheap))
    one, a = torch.ones(1), torch.tensor([0.2])  # the real pair at T=1
    assert float(draft_gain(one, a, 0, 1, cheap, one)[0, 1]) > 0
    clamped = dataclasses.replace(cheap, round_overhead=0.1)  # the verify priced at >= 1 step
    assert float(draft_gain(one, a, 0, 1, clamped, one)[0, 1]) < 0


# ---------------------------------------------------------------- replay (held-out prediction)


def _outcomes(target, drafter, prompt: list[int], n: int) -> tuple[list[bool], list[float]]:
    """Teacher-forced on the target's greedy continuation: does q's argmax match it, and q's
    probability of its argmax, at each of the n continuation positions."""
    ref = greedy_reference(target, prompt, n)
    with torch.no_grad():
        logits = drafter(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1].float()
    q = torch.softmax(logits, -1)
    return (logits.argmax(-1) == torch.tensor(ref)).tolist(), q.max(-1).values.tolist()


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence"])
@pytest.mark.parametrize("costs", [CHEAP, DEAR], ids=["cheap", "dear"])
def test_replay_predicts_the_decoders_rounds(pair, policy, costs):
    """`replay` over teacher-forced outcomes is the greedy decoder's own run: the same rounds,
    draft lengths and target forwards (fixed, heuristic: exactly); the confidence policy reads
    confidences past a rejection that the decoder computed on its own draft, so only close."""
    target, drafter = pair
    n = 32
    cfg = dict(max_new_tokens=n, draft_length=policy, gamma=3, max_draft=6, probe_every=3)
    got_forwards = want_forwards = 0
    got_drafts = want_drafts = 0
    for prompt in prompts(4, 64, seed=11):
        dec = SpeculativeDecoder(target, drafter, DecoderConfig(**cfg, draft_costs=costs))
        out = dec.generate(torch.tensor([prompt]))
        accepted, conf = _outcomes(target, drafter, prompt, n)
        rep = replay(accepted, conf, make_policy(policy, 3, 6 if policy != "fixed" else 3,
                                                 costs, probe_every=3))  # fmt: skip
        assert rep.tokens == len(out.tokens[0]) == n
        if policy != "confidence":
            assert rep.rounds + rep.target_steps == out.target_forwards
            assert rep.target_steps == out.draft_lengths[0]
            assert rep.drafts == sum(k * c for k, c in enumerate(out.draft_lengths))
        got_forwards += rep.rounds + rep.target_steps
        want_forwards += out.target_forwards
        got_drafts += rep.drafts
        want_drafts += sum(k * c for k, c in enumerate(out.draft_lengths))
    assert got_forwards == pytest.approx(want_forwards, rel=0.15)
    assert got_drafts == pytest.approx(want_drafts, rel=0.2, abs=2)


def test_replay_cost_model_by_hand():
    """Fixed gamma 2 over a known outcome string: rounds, tokens and modeled cost by hand."""
    costs = DraftCosts(c=0.5, verify_per_token=0.1, round_overhead=0.2)
    # rounds: [1,1] all accepted -> 3 tokens; [0] -> 1 token; [1,0] -> 2 tokens; last: 1 left
    rep = replay(
        [True, True, True, False, True, False, True], None, make_policy("fixed", 2, 2, costs)
    )
    assert (rep.rounds, rep.tokens, rep.target_steps) == (4, 7, 0)
    per_round = costs.round_cost(2)
    # budget shrinks at the end: the last round (1 token left) drafts max(1, 0) = 1
    assert rep.drafts == 2 + 2 + 2 + 1
    assert rep.cost == pytest.approx(3 * per_round + costs.round_cost(1))
    assert rep.figures()["speedup"] == pytest.approx(round(7 / rep.cost, 3))
