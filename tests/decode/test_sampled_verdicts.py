"""Sampled rounds teach the draft-length policies each draft's acceptance probability.

p = target, q = drafter. When sampling, a tested draft x is accepted iff a uniform falls under
min(1, p(x)/q(x)); the policies' averages and calibrations learn from that probability instead
of the coin's 0/1 outcome (`policies.verdicts`). These tests check the two have the same
expectation at every draft position by exact enumeration of drafts and coins, that the
probabilities keep a drafter that pays from looking as if it did not, and that a sampled decode
hands the policy fractional probabilities (greedy: none) while its output stays the target's.
The floor's averages learn each tested position's expected acceptance sum_x min(p, q) instead:
the same expectation once more, averaged over the drafted token too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import acceptance_probs, expected_alpha, verify_sampling
from specdistill.decode.draft_length import DraftCosts, make_policy
from specdistill.decode.draft_length.policies import verdicts
from specdistill.decode.outputs import VerifiedRow
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.decode.test_draft_length import pair as pair
from tests.decode.test_speculative import greedy_reference, prompts


def test_verdicts_by_hand():
    assert verdicts(2, 4, None) == [1.0, 1.0, 0.0]  # two accepted, the third rejected
    assert verdicts(3, 3, None) == [1.0, 1.0, 1.0]  # all accepted: nothing else tested
    assert verdicts(0, 2, None) == [0.0]
    assert verdicts(1, 3, [0.9, 0.25, 0.7]) == [0.9, 0.25]  # the tested prefix's probabilities
    assert verdicts(2, 2, [0.5, 1.0]) == [0.5, 1.0]


def test_probabilities_have_the_coins_expectation_at_every_position():
    """Two drafts over a 4-token vocabulary whose acceptance probabilities are multiples of 1/8:
    every draft pair (weighted by q) and every coin on a 16-point midpoint grid (exact for such
    probabilities) through `verify_sampling`; per position, the summed 0/1 verdicts and the
    summed probability verdicts of the tested drafts have the same expectation, and the
    probabilities' second moment is no larger (less noise for the same mean). The second
    position's p depends on the first draft (p2[x1]), as a real target's does; the expected
    acceptances sum_x min(p, q) of the tested positions (what the floor learns) have the coins'
    expectation too, with a second moment no larger than the probabilities'."""
    p1 = torch.tensor([0.5, 0.25, 0.125, 0.125])
    p2 = torch.tensor(
        [
            [0.25] * 4,
            [0.5, 0.125, 0.25, 0.125],
            [0.125, 0.5, 0.25, 0.125],
            [0.25, 0.5, 0.125, 0.125],
        ]
    )
    q = torch.tensor([[0.25, 0.5, 0.125, 0.125], [0.5, 0.125, 0.25, 0.125]])[None]
    grid = [(i + 0.5) / 16 for i in range(16)]
    coins, probs, alphas = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    coins2, probs2, alphas2 = 0.0, 0.0, 0.0
    for x1, x2 in itertools.product(range(4), repeat=2):
        p = torch.stack([p1, p2[x1], torch.full((4,), 0.25)])[None]
        draft = torch.tensor([[x1, x2]])
        weight_x = float(q[0, 0, x1] * q[0, 1, x2])
        acc = acceptance_probs(p[:, :2], q, draft)
        assert all(float(a) * 8 == int(float(a) * 8) for a in acc[0])  # the grid is exact
        exp_alpha = expected_alpha(p[:, :2], q)[0].tolist()
        for u1, u2 in itertools.product(grid, repeat=2):
            w = weight_x / len(grid) ** 2
            n, _ = verify_sampling(draft, p, q, torch.tensor([[u1, u2]]), torch.tensor([0.5]))
            by_coin = verdicts(int(n), 2, None)
            by_prob = verdicts(int(n), 2, acc[0].tolist())
            by_alpha = verdicts(int(n), 2, exp_alpha)
            assert len(by_coin) == len(by_prob) == len(by_alpha)  # the same drafts were tested
            for j, (c, pr, al) in enumerate(zip(by_coin, by_prob, by_alpha)):
                coins[j] += w * c
                probs[j] += w * pr
                alphas[j] += w * al
            coins2 += w * sum(c * c for c in by_coin)
            probs2 += w * sum(pr * pr for pr in by_prob)
            alphas2 += w * sum(al * al for al in by_alpha)
    assert probs == pytest.approx(coins, abs=1e-12)
    assert alphas == pytest.approx(coins, abs=1e-12)
    assert alphas2 < probs2 < coins2


def test_a_drafter_that_pays_rarely_looks_as_if_it_did_not():
    """Rounds of one draft whose acceptance probabilities are 0.2 or 0.7 (mean 0.45) where a
    draft pays from 0.3 on: after 30 rounds the floor (one draft's acceptance, moving average)
    judges drafting unpaid in far fewer runs when it learns the probabilities than the coins."""
    costs = DraftCosts(c=0.2, verify_per_token=0.05, round_overhead=0.05)
    assert costs.round_cost(1) == pytest.approx(1.3)  # 1 + a > 1.3: a > 0.3
    rng = torch.Generator().manual_seed(5)
    unpaid = {"coins": 0, "probs": 0}
    trials = 400
    for _ in range(trials):
        r = torch.where(torch.rand(30, generator=rng) < 0.5, 0.2, 0.7)
        ok = (torch.rand(30, generator=rng) < r).long().tolist()
        for kind in unpaid:
            pol = make_policy("fixed", 1, 1, costs)
            pol.start(1)
            for a, pr in zip(ok, r.tolist()):
                pol.observe([1], [a], [True], None, [[pr]] if kind == "probs" else None)
            unpaid[kind] += not pol._pays([True])
    assert unpaid["probs"] < unpaid["coins"] / 2
    assert unpaid["coins"] / trials > 0.05


def test_a_verified_row_names_the_host_layout():
    """[drafts, accepted, next, alphas, probs] as `settle` moves it: greedy rows have no probs."""
    greedy = VerifiedRow.from_host([7.0, 8.0, 1.0, 9.0, 1.0, 0.0], 2)
    assert greedy == VerifiedRow([7, 8], 1, 9, [1.0, 0.0], [])
    assert greedy.emitted() == [7, 9]
    sampled = VerifiedRow.from_host([7.0, 8.0, 2.0, 3.0, 0.6, 0.4, 0.9, 0.5], 2)
    assert (sampled.alphas, sampled.probs) == ([0.6, 0.4], [0.9, 0.5])
    assert sampled.emitted() == [7, 8, 3] and isinstance(sampled.accepted, int)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_decode_hands_the_policy_probabilities_when_sampling(pair, temperature):
    target, drafter = pair
    cfg = DecoderConfig(
        max_new_tokens=24,
        sampling=Sampling(temperature),
        draft_length="confidence",
        max_draft=3,
        draft_floor=False,
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    prompt = prompts(1, 64, seed=2)[0]
    dec.generate(torch.tensor([prompt]), generator=torch.Generator().manual_seed(0))
    pol = dec.get_policy(None)
    seen = []
    observe = pol.observe

    def spy(lengths, accepted, active, conf, probs=None, alphas=None):
        seen.append((list(lengths), list(accepted), probs, alphas))
        return observe(lengths, accepted, active, conf, probs, alphas)

    pol.observe = spy
    out = dec.generate(torch.tensor([prompt]), generator=torch.Generator().manual_seed(1))
    assert seen
    if temperature == 0.0:
        assert all(probs is None and alphas is None for _, _, probs, alphas in seen)
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        return
    values, expected = [], []
    for lengths, accepted, probs, alphas in seen:
        assert probs is not None and len(probs[0]) == max(lengths)
        assert alphas is not None and len(alphas[0]) == max(lengths)
        values += verdicts(accepted[0], lengths[0], probs[0])
        expected += verdicts(accepted[0], lengths[0], alphas[0])
    assert all(0.0 <= v <= 1.0 for v in values + expected)
    assert any(0.0 < v < 1.0 for v in values)  # probabilities, not coins
    assert any(abs(a - b) > 1e-6 for a, b in zip(values, expected))  # two different figures


def test_the_floor_learns_expected_acceptance_and_the_calibration_the_draft_s():
    """Given both, the floor's averages move towards the positions' expected acceptance and the
    confidence calibration fits the drafted tokens' own acceptance probabilities."""
    costs = DraftCosts(c=0.2, verify_per_token=0.05, round_overhead=0.05)
    pol = make_policy("confidence", 2, 2, costs)
    fitted = []
    update = pol.accept.update
    pol.accept.update = lambda cs, rs, oks: (fitted.extend(oks), update(cs, rs, oks))
    for _ in range(40):
        pol.start(1)
        pol.plan(2, [True])
        pol.observe([2], [1], [True], [[0.5, 0.5]], [[0.9, 0.8]], [[0.2, 0.1]])
    assert pol.first[0] == pytest.approx(0.2, abs=0.02)  # the lifetime prior: the alphas
    assert pol.follow[0] == pytest.approx(0.1, abs=0.02)
    assert set(fitted) == {0.9, 0.8}
