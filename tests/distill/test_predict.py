"""The held-out replay (distill/train/predict.py) against brute force: every agreement string
of a few positions, replayed by an independent simulation and by the decoder's own policy
objects driven as the decoder drives them; hand-worked rounds of each policy; the settings."""

from __future__ import annotations

import itertools

import pytest

from specdistill.data.runtime import ConfigError
from specdistill.decode.draft_length import DraftCosts, expected_tokens, make_policy
from specdistill.distill.train.predict import Rounds, predict, replay
from specdistill.distill.train.settings_sections import PredictSettings
from tests.conftest import stage_node


def _predict(**keys):
    """distill.yaml's `eval.predict` node with `keys` over it."""
    return stage_node("distill", "eval.predict", **keys)


COSTS = DraftCosts(c=0.25, verify_per_token=0.05)


def strings(max_len: int):
    for n in range(1, max_len + 1):
        yield from (list(bits) for bits in itertools.product((False, True), repeat=n))


def fixed_rounds(agree: list[bool], gamma: int) -> int:
    """Rounds of a fixed-gamma decode, recursively: draft min(gamma, left - 1) (at least 1),
    drop the accepted prefix and the token after it."""
    if not agree:
        return 0
    k = max(1, min(gamma, len(agree) - 1))
    n = next((i for i, a in enumerate(agree[:k]) if not a), k)
    return 1 + fixed_rounds(agree[n + 1 :], gamma)


def decoder_rounds(agree, conf, name, gamma, max_draft, p_min, costs):
    """The decoder's policy object over one row, called as `SpeculativeDecoder._round` and the
    drafter's `_steps` call it: (verified, accepted) per round and the modeled cost, drafter
    forwards as the drafter counts them (1 + fed)."""
    pol = make_policy(name, gamma, max_draft, p_min)
    pol.start(1)
    most = max_draft if name == "heuristic" else gamma  # DecoderConfig.most_drafts
    pos, rounds, cost = 0, [], 0.0
    while pos < len(agree):
        budget = max(1, min(most, len(agree) - pos - 1))
        k = pol.plan(budget)
        tops = []
        for i in range(k):
            if pol.reads_q and not pol.keep_drafting([conf[pos + i]], [True]):
                break
            tops.append(conf[pos + i])
        drafted = len(tops)
        forwards = 1 + (drafted if drafted < k else k - 1)
        (v,) = pol.lengths([tops] if pol.reads_q else None, drafted, 1)
        n = next((i for i in range(v) if not agree[pos + i]), v)
        pol.observe([v], [n], [True])
        rounds.append((v, n))
        cost += forwards * costs.c + 1.0 + v * costs.verify_per_token
        pos += n + 1
    return rounds, cost


def check_against_decoder(agree, conf, name, gamma, max_draft, p_min):
    got = replay(agree, conf, name, gamma=gamma, max_draft=max_draft, p_min=p_min, costs=COSTS)
    rounds, cost = decoder_rounds(agree, conf, name, gamma, max_draft, p_min, COSTS)
    assert got.tokens == len(agree)  # every position is emitted once
    assert got.rounds == len(rounds)
    assert got.drafts == sum(v for v, _ in rounds)
    assert got.target_steps == sum(v == 0 for v, _ in rounds)
    assert got.cost == pytest.approx(cost)
    most = len(got.trials)
    trials = [sum(1 for v, n in rounds if j < v and j <= n) for j in range(most)]
    accepts = [sum(1 for v, n in rounds if j < v and j < n) for j in range(most)]
    assert (got.trials, got.accepts) == (trials, accepts)


@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_fixed_gamma_matches_brute_force_on_every_string(gamma):
    for agree in strings(8):
        got = replay(agree, None, "fixed", gamma=gamma, max_draft=15, p_min=0.0, costs=COSTS)
        assert got.rounds == fixed_rounds(agree, gamma), agree
        assert got.tokens == len(agree)
        check_against_decoder(agree, [1.0] * len(agree), "fixed", gamma, 15, 0.0)


@pytest.mark.parametrize(("gamma", "max_draft"), [(1, 3), (2, 6), (4, 4), (3, 8)])
def test_heuristic_matches_the_decoders_policy_on_every_string(gamma, max_draft):
    for agree in strings(8):
        check_against_decoder(agree, [1.0] * len(agree), "heuristic", gamma, max_draft, 0.0)


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_confidence_matches_the_decoders_policy_on_every_string_and_cut(gamma):
    """Every agreement string of up to 6 positions with every pattern of confident (0.9) and
    unconfident (0.4) drafts at p_min 0.5."""
    for agree in strings(6):
        for bits in itertools.product((0.4, 0.9), repeat=len(agree)):
            check_against_decoder(agree, list(bits), "confidence", gamma, 15, 0.5)


def test_hand_worked_rounds_of_each_policy():
    c = DraftCosts(c=0.1)
    # fixed 4 over 11110111: 4 drafts accepted (+1), then 2 left-capped drafts accepted (+1)
    r = replay([True] * 4 + [False] + [True] * 3, None, "fixed", gamma=4, max_draft=8,
               p_min=0.0, costs=c)  # fmt: skip
    assert (r.rounds, r.drafts, r.tokens) == (2, 6, 8)
    assert r.cost == pytest.approx((0.4 + 1) + (0.2 + 1))
    assert r.figures()["acceptance_by_position"] == [1.0, 1.0, 1.0, 1.0]
    # heuristic from 1 on ten agreeing positions: k 1, 3, then 5 capped by the 3 left
    r = replay([True] * 10, None, "heuristic", gamma=1, max_draft=5, p_min=0.0, costs=c)
    assert (r.rounds, r.drafts, r.tokens) == (3, 7, 10)
    assert r.figures()["tau"] == 3.333
    # heuristic shrinks after a rejection: k 3 (rejected at 2), then 2, then 1 at each of
    # the 5 positions left
    r = replay([True, False] + [False] * 6, None, "heuristic", gamma=3, max_draft=5,
               p_min=0.0, costs=c)  # fmt: skip
    assert (r.drafts, r.rounds) == (3 + 2 + 5, 7) and (r.trials[:2], r.accepts[:2]) == (
        [7, 1],
        [1, 0],
    )
    # confidence 3 at p_min 0.5: cut before the 0.4 draft (paid), then 3 confident drafts
    conf = [0.9, 0.4, 0.9, 0.9, 0.9, 0.9]
    r = replay([True] * 6, conf, "confidence", gamma=3, max_draft=8, p_min=0.5, costs=c)
    assert (r.rounds, r.drafts, r.tokens, r.target_steps) == (2, 4, 6, 0)
    assert r.cost == pytest.approx(1.2 + 1.3) and r.figures()["speedup"] == 2.4
    # an unconfident first draft: a plain target step (1 token) that paid one drafter step
    r = replay([True, True], [0.4, 0.9], "confidence", gamma=3, max_draft=8, p_min=0.5, costs=c)
    assert (r.rounds, r.drafts, r.target_steps, r.tokens) == (2, 1, 1, 2)
    assert r.figures()["target_step_share"] == 0.5


def test_tau_approaches_the_cost_models_expected_tokens():
    """Long strings of runs of known length: fixed-gamma tau and acceptance by position agree
    with `expected_tokens` of the replayed acceptances (up to the end of each string)."""
    agree = ([True] * 3 + [False]) * 500  # every round: 3 accepted, rejected at the 4th
    r = replay(agree, None, "fixed", gamma=4, max_draft=8, p_min=0.0, costs=COSTS)
    acc = r.figures()["acceptance_by_position"]
    assert acc == [1.0, 1.0, 1.0, 0.0]
    assert r.figures()["tau"] == pytest.approx(expected_tokens(acc), abs=1e-2)


def test_predict_sums_rows_and_labels_fixed_by_gamma():
    rows = [([True, True, False, True], [0.9, 0.2, 0.9, 0.9]), ([False] * 3, [0.9] * 3)]
    figs = predict(rows, gamma=2, max_draft=4, p_min=0.5, costs=COSTS)
    assert set(figs) == {"gamma=2", "heuristic", "confidence"}
    for label, name in (("gamma=2", "fixed"), ("heuristic", "heuristic"), ("confidence",) * 2):
        total = Rounds()
        for agree, conf in rows:
            total = total.add(replay(agree, conf, name, gamma=2, max_draft=4, p_min=0.5,
                                     costs=COSTS))  # fmt: skip
        assert figs[label] == total.figures()
        assert set(figs[label]) == {"tau", "mean_draft_length", "target_step_share",
                                    "acceptance_by_position", "rounds", "speedup"}  # fmt: skip


def test_replay_rejects_mismatched_inputs():
    kw = {"gamma": 2, "max_draft": 4, "p_min": 0.5, "costs": COSTS}
    with pytest.raises(ValueError, match="conf has 1 positions"):
        replay([True, False], [0.9], "fixed", **kw)
    with pytest.raises(ValueError, match="pass conf"):
        replay([True], None, "confidence", **kw)
    with pytest.raises(ValueError, match="policy='floor'"):
        replay([True], None, "floor", **kw)


def test_predict_settings_take_mappings_and_name_removed_or_bad_costs():
    s = PredictSettings.from_node(_predict(costs={"c": 0.2, "verify_per_token": 0.01}, p_min=1))
    assert s.costs == {"c": 0.2, "verify_per_token": 0.01} and s.p_min == 1.0
    default = PredictSettings.from_node(_predict())
    assert default.costs is None and default.p_min == 0.75
    with pytest.raises(ConfigError, match=r"^eval\.predict\.costs is missing"):
        PredictSettings.from_node({})  # a node without a key: no second default fills it
    for node, message in [
        ({"costs": "auto"}, "eval.predict.costs=auto was removed"),
        ({"costs": {"round_overhead": 0.1}}, "eval.predict.costs: unknown key(s)"),
        ({"costs": 0.3}, "eval.predict.costs=0.3"),
        ({"gamma": 0}, "eval.predict.gamma=0 must be an integer in 1..15"),
        ({"max_draft": "auto"}, "eval.predict.max_draft='auto'"),
        ({"p_min": 2}, "eval.predict.p_min=2.0 must lie in [0, 1]"),
    ]:
        with pytest.raises(ConfigError) as err:
            PredictSettings.from_node(_predict(**node))
        assert str(err.value).startswith(message), node
