"""Draft length (decode.draft_length): the cost model and the recommended K against brute-force
enumeration, the policies by hand, and the decoder's losslessness under every policy and
drafting kind (greedy token-identical to the target, sampling by chi-square on a small vocab).

p = target, q = drafter, K = drafts a round. A policy may read q and earlier rounds only; these
tests show that whatever length it picks, greedy output is the target's and sampled output
follows p.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import verify_sampling
from specdistill.decode.draft_length import (
    DraftCosts,
    chunk_widths,
    costs_from_mapping,
    expected_tokens,
    make_policy,
    recommend_k,
    speedup_at,
    speedup_table,
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
from tests.decode.test_parallel import MASK
from tests.decode.test_parallel import pair as parallel_pair  # noqa: F401  (fixture)
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy

# ---------------------------------------------------------------- the cost model, by enumeration


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


def brute_cost(k: int, c: float, v: float, parallel: bool, per: float) -> float:
    """A round of k drafts in target steps, written out: drafting, then a verify of k + 1."""
    drafting = (c + (k - 1) * per) if parallel else k * c
    return drafting + 1.0 + k * v


@pytest.mark.parametrize("accept", [[], [0.3], [0.9, 0.5], [0.2, 0.8, 0.6, 1.0], [0.7] * 5])
def test_expected_tokens_matches_enumeration(accept):
    assert expected_tokens(accept) == pytest.approx(brute_tokens(accept), abs=1e-12)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("g", [1, 3, 7])
def test_expected_tokens_is_leviathans_closed_form_at_one_alpha(a, g):
    assert expected_tokens([a] * g) == pytest.approx((1 - a ** (g + 1)) / (1 - a))


def test_round_cost_by_hand():
    assert DraftCosts(c=0.2, verify_per_token=0.05).round_cost(4) == pytest.approx(0.8 + 1.2)
    par = DraftCosts(c=0.3, verify_per_token=0.1, parallel=True, draft_per_token=0.02)
    assert par.round_cost(3) == pytest.approx(0.3 + 0.04 + 1.3)
    assert par.round_cost(0) == 1.0  # a plain target step


@pytest.mark.parametrize("seed", range(40))
def test_recommend_k_is_the_argmax_of_brute_force(seed):
    """Random acceptances by position and costs: the recommended K and its speedup are those of
    an exhaustive search over K, each K's tokens enumerated outcome by outcome."""
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    accept = [rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(n)]
    c, v = rng.choice([0.01, 0.05, 0.2, 0.6, 1.2]), rng.choice([0.0, 0.02, 0.2])
    parallel, per = rng.random() < 0.3, rng.choice([0.0, 0.01])
    costs = DraftCosts(c=c, verify_per_token=v, parallel=parallel, draft_per_token=per)
    brute = {
        k: brute_tokens(accept[:k]) / brute_cost(k, c, v, parallel, per) for k in range(1, n + 1)
    }
    top = max(brute.values())
    k, speed = recommend_k(accept, costs)
    assert speed == pytest.approx(top, rel=1e-9)
    assert k == min(j for j, s in brute.items() if s >= top - 1e-12)  # the smallest on a tie
    assert speedup_table(accept, costs) == [round(brute[j], 4) for j in range(1, n + 1)]
    assert speedup_at(accept, k, costs) == pytest.approx(brute[k])


def test_recommend_k_by_hand():
    """Perfect acceptance and free drafts: the longest K; a useless drafter: K=1, below 1x."""
    assert recommend_k([1.0] * 6, DraftCosts(c=0.0)) == (6, pytest.approx(7.0))
    k, speed = recommend_k([0.0] * 4, DraftCosts(c=0.5))
    assert k == 1 and speed == pytest.approx(1 / 1.5)
    with pytest.raises(ValueError, match="nothing to recommend"):
        recommend_k([], DraftCosts())


def test_costs_from_mapping_names_the_bad_key():
    assert costs_from_mapping({"c": 0.1}) == DraftCosts(c=0.1)
    with pytest.raises(ValueError, match="round_overhead"):
        costs_from_mapping({"c": 0.1, "round_overhead": 0.2})
    with pytest.raises(ValueError, match="c=-1"):
        costs_from_mapping({"c": -1})


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


# ---------------------------------------------------------------- the policies, by hand


def test_heuristic_schedule_is_transformers():
    """+2 after a round every active row accepted whole, else -1 (at least 1, at most max)."""
    pol = make_policy("heuristic", 3, 6)
    pol.start(2)
    seen = []
    for accepted in ([3, 3], [5, 5], [6, 2], [1, 0], [1, 1], [0, 0], [0, 0], [1, 9]):
        k = pol.plan(budget=99)
        seen.append(k)
        pol.observe([k, k], [min(a, k) for a in accepted], [True, accepted != [1, 9]])
    assert seen == [3, 5, 6, 5, 4, 3, 2, 1]
    assert pol.plan(budget=99) == 3  # [1, 9] at k=1: the inactive row does not count
    assert pol.plan(budget=1) == 1
    pol.start(1)
    assert pol.plan(budget=99) == 3  # a new decode starts at gamma again


def test_confidence_lengths_stop_at_the_first_unconfident_draft():
    pol = make_policy("confidence", 4, 4, p_min=0.5)
    assert pol.keep_drafting([0.9, 0.4], [True, True])
    assert pol.keep_drafting([0.6, 0.99], [True, True])  # row 1 stopped already
    assert not pol.keep_drafting([0.3, 0.99], [True, True])  # no row confident: stop drafting
    tops = [[0.9, 0.6, 0.3], [0.4, 0.99, 0.99]]
    assert pol.lengths(tops, 3, 2) == [2, 0]
    fixed = make_policy("fixed", 4, 4)
    assert fixed.plan(99) == 4 and fixed.lengths(None, 4, 3) == [4, 4, 4]
    assert not fixed.reads_q


def test_bad_draft_length_settings_name_the_field():
    target = tiny_llama(vocab=64, layers=1)
    for kwargs, field in (
        ({"draft_length": "auto"}, "decoder.draft_length"),
        ({"max_draft": 0}, "decoder.max_draft"),
        ({"max_draft": 16}, "decoder.max_draft"),
        ({"p_min": 1.5}, "decoder.p_min"),
        ({"gamma": 0}, "decoder.gamma"),
    ):
        with pytest.raises(ConfigError, match=rf"^{field}="):
            SpeculativeDecoder(target, target, DecoderConfig(**kwargs))


# ---------------------------------------------------------------- greedy: token-identical


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    return target, truncated_copy(target)


POLICIES = [
    ("fixed", {}),
    ("heuristic", {"max_draft": 6}),
    ("confidence", {"p_min": "median"}),
]


@torch.no_grad()
def median_top(drafter, rows: list[list[int]]) -> float:
    """The median of q's top probability over the prompts' positions: a p_min that stops some
    rounds early and lets others run (a random tiny drafter is nearly uniform)."""
    tops = [torch.softmax(drafter(torch.tensor([r])).logits[0].float(), -1).max(-1).values
            for r in rows]  # fmt: skip
    return float(torch.cat(tops).median())


def _extra(extra: dict, drafter, rows: list[list[int]]) -> dict:
    return {k: median_top(drafter, rows) if v == "median" else v for k, v in extra.items()}


def _parallel(policy: str, **kw) -> DecoderConfig:
    return DecoderConfig(drafting="parallel", mask_token_id=MASK, draft_length=policy, **kw)


@pytest.mark.parametrize(("policy", "extra"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_every_policy_greedy_is_token_identical_batch1(pair, policy, extra, cache):
    target, drafter = pair
    rows = prompts(4, 64, seed=3)
    extra = _extra(extra, drafter, rows)
    cfg = DecoderConfig(max_new_tokens=24, draft_length=policy, gamma=3, cache=cache, **extra)
    dec = SpeculativeDecoder(target, drafter, cfg)
    lengths = [0] * (dec.max_draft + 1)
    for prompt in rows:
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        lengths = [a + b for a, b in zip(lengths, out.draft_lengths)]
    if policy != "fixed":  # lengths really varied
        assert sum(1 for n in lengths if n) >= 2


@pytest.mark.parametrize(("policy", "extra"), POLICIES, ids=[p for p, _ in POLICIES])
def test_every_policy_greedy_batched_uneven_prompts(pair, policy, extra):
    target, drafter = pair
    rows = prompts(5, 64, seed=4)
    extra = _extra(extra, drafter, rows)
    cfg = DecoderConfig(max_new_tokens=20, draft_length=policy, gamma=3, cache="static", **extra)
    dec = SpeculativeDecoder(target, drafter, cfg)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, r, 20) for r in rows]
    assert sum(out.draft_lengths) == out.row_rounds


def test_confidence_with_an_unconfident_drafter_takes_plain_target_steps(pair):
    """p_min=1: no draft is confident, every round verifies none (a plain target step)."""
    target, drafter = pair
    cfg = DecoderConfig(max_new_tokens=16, draft_length="confidence", p_min=1.0)
    dec = SpeculativeDecoder(target, drafter, cfg)
    prompt = prompts(1, 64, seed=5)[0]
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 16)
    assert out.draft_lengths[0] == out.row_rounds == out.target_forwards and out.trials == 0


@pytest.mark.parametrize(("policy", "extra"), POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("rows", [1, 4])
def test_every_policy_parallel_greedy_is_token_identical(parallel_pair, policy, extra, rows):  # noqa: F811
    target, drafter = parallel_pair
    batch = prompts(rows, 8, seed=2)
    cfg = _parallel(policy, gamma=4, max_new_tokens=24, **_extra(extra, drafter, batch))
    dec = SpeculativeDecoder(target, drafter, cfg)
    ids, mask = left_pad(batch)
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, r, 24) for r in batch]
    assert sum(out.draft_lengths) == out.row_rounds


def test_heuristic_parallel_rounds_stop_at_the_trained_depth(parallel_pair):  # noqa: F811
    """A parallel drafter trained for 2 drafts a round (`parallel_drafting.max_drafts`): the
    heuristic grows rounds to 2 at most; a fixed gamma stays the user's."""
    import copy

    target, drafter = parallel_pair
    trained = copy.deepcopy(drafter)
    trained.config.parallel_drafting = {"mask_token_id": MASK, "max_drafts": 2}
    dec = SpeculativeDecoder(target, trained, _parallel("heuristic", gamma=4, max_draft=8))
    assert dec.max_draft == 2
    prompt = prompts(1, 8, seed=4)[0]
    assert dec.generate(torch.tensor([prompt])).tokens[0] == greedy_reference(target, prompt, 64)
    assert SpeculativeDecoder(target, trained, _parallel("fixed", gamma=4)).max_draft == 4


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
    ("policy", "drafting", "rows", "calls"),
    [
        ("heuristic", "autoregressive", 1, 1024),
        ("heuristic", "autoregressive", 512, 16),
        ("confidence", "autoregressive", 1, 1024),
        ("confidence", "autoregressive", 512, 16),
        ("heuristic", "parallel", 512, 16),
        ("confidence", "parallel", 512, 16),
    ],
)
def test_every_policy_sampling_matches_target_distribution(models, policy, drafting, rows, calls):  # noqa: F811
    """The exact 3-token sequence law of target-only sampling against the decoder's samples
    under each adaptive policy, batch 1 and batched (rows verify different lengths); fixed K
    is test_distribution.py's and test_parallel.py's."""
    target, drafter = models
    s = Sampling(1.0)
    kw = {"mask_token_id": 3} if drafting == "parallel" else {}
    cfg = DecoderConfig(
        max_new_tokens=3, sampling=s, draft_length=policy, drafting=drafting, gamma=2,
        max_draft=3, p_min=0.4, **kw,
    )  # fmt: skip
    dec = SpeculativeDecoder(target, drafter, cfg)
    counts, lengths = _sample(dec, rows, calls, seed=21)
    assert chi2_pvalue(exact_sequence_probs(target, s), counts, rows * calls) > 1e-3
    assert sum(1 for x in lengths if x) >= 2  # lengths really varied
