"""measure.py's figures against brute force over synthetic requests built round by round,
the way llama-server counts them: a first token from the prompt's forward, then rounds that
each emit their accepted drafts plus one token of the target's."""

from __future__ import annotations

import random

import pytest

from specdistill.decode.llamacpp.measure import (
    acceptance,
    engine_figures,
    mismatches,
    rounds,
    speedup,
    tau,
    tokens_per_second,
)
from specdistill.decode.llamacpp.server import Completion


def _request(rng: random.Random, n_predict: int, k: int, ms_per_round: float) -> tuple:
    """A synthetic request: (Completion, its true round count, its true decode tokens)."""
    emitted, drafted, accepted, n_rounds = 1, 0, 0, 0  # the prompt's forward samples token 1
    while emitted < n_predict:
        kk = min(k, n_predict - emitted - 1)  # the server never drafts past the tokens left
        kk = rng.choice([0, kk]) if kk else 0  # some rounds draft nothing (a plain step)
        a = rng.randint(0, kk)
        drafted, accepted, n_rounds, emitted = (
            drafted + kk,
            accepted + a,
            n_rounds + 1,
            emitted + a + 1,
        )
    c = Completion(
        tokens=[rng.randrange(100) for _ in range(emitted)],
        predicted_n=emitted,
        predicted_ms=ms_per_round * n_rounds,
        predicted_per_second=0.0,
        prompt_n=5,
        prompt_ms=1.0,
        draft_n=drafted,
        draft_n_accepted=accepted,
    )
    return c, n_rounds, emitted - 1


@pytest.mark.parametrize("k", [1, 3, 8])
def test_rounds_and_tau_match_brute_force(k):
    rng = random.Random(k)
    reqs = [_request(rng, rng.randint(1, 40), k, 10.0) for _ in range(50)]
    for c, n_rounds, _ in reqs:
        assert rounds(c) == n_rounds
        assert c.predicted_n == 1 + n_rounds + c.draft_n_accepted
    comps = [c for c, _, _ in reqs]
    true_rounds = sum(r for _, r, _ in reqs)
    true_tokens = sum(t for _, _, t in reqs)
    assert tau(comps) == pytest.approx(true_tokens / true_rounds)
    assert 1.0 <= tau(comps) <= k + 1
    drafted = sum(c.draft_n for c in comps)
    assert acceptance(comps) == pytest.approx(sum(c.draft_n_accepted for c in comps) / drafted)


def test_every_draft_accepted_gives_tau_k_plus_one():
    # 1 + 5 rounds of 3 accepted drafts + bonus: 21 tokens, 15 drafted, 15 accepted
    c = Completion([0] * 21, 21, 50.0, 0.0, 4, 1.0, draft_n=15, draft_n_accepted=15)
    assert rounds(c) == 5 and tau([c]) == 4.0 and acceptance([c]) == 1.0


def test_plain_requests_have_tau_one_and_no_acceptance():
    c = Completion([1] * 24, 24, 230.0, 100.0, 4, 1.0)
    assert rounds(c) == 23 and tau([c]) == 1.0 and acceptance([c]) == 0.0
    assert tokens_per_second([c]) == pytest.approx(100.0)  # the server's own predicted_per_second


def test_tokens_per_second_pools_and_speedup_is_the_ratio():
    plain = [
        Completion([0] * 11, 11, 100.0, 0.0, 3, 1.0),
        Completion([0] * 21, 21, 300.0, 0.0, 3, 1.0),
    ]
    spec = [
        Completion([0] * 11, 11, 50.0, 0.0, 3, 1.0),
        Completion([0] * 21, 21, 150.0, 0.0, 3, 1.0),
    ]
    assert tokens_per_second(plain) == pytest.approx(1000 * 30 / 400)
    assert speedup(plain, spec) == pytest.approx(2.0)
    assert tokens_per_second([]) == 0.0 and speedup([], spec) == 0.0


def test_identity_names_the_differing_requests():
    a = [Completion([1, 2, 3], 3, 1.0, 0.0, 1, 1.0), Completion([4, 5], 2, 1.0, 0.0, 1, 1.0)]
    b = [Completion([1, 2, 3], 3, 1.0, 0.0, 1, 1.0), Completion([4, 6], 2, 1.0, 0.0, 1, 1.0)]
    assert mismatches(a, a) == [] and mismatches(a, b) == [1]
    figures = engine_figures(a, b)
    assert not figures.greedy_identical and figures.mismatched == [1] and figures.requests == 2
    with pytest.raises(ValueError, match="2 plain completions against 1"):
        mismatches(a, b[:1])


def test_completion_parses_the_server_answer():
    body = {
        "tokens": [5, 6, 7],
        "stop_type": "limit",
        "timings": {
            "prompt_n": 4,
            "prompt_ms": 2.5,
            "predicted_n": 3,
            "predicted_ms": 20.0,
            "predicted_per_second": 100.0,
            "draft_n": 3,
            "draft_n_accepted": 1,
        },
    }
    c = Completion.from_response(body)
    assert (c.tokens, c.predicted_n, c.draft_n, c.draft_n_accepted) == ([5, 6, 7], 3, 3, 1)
    assert c.stop_type == "limit" and c.prompt_n == 4
    plain = Completion.from_response({"tokens": [1], "timings": {"predicted_n": 1}})
    assert plain.draft_n == 0 and plain.draft_n_accepted == 0  # the server omits them
