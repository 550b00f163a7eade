"""Parallel drafting (decode.drafters.parallel) is lossless; the drafter caches real tokens only.

p = target, q = drafter. The drafters are untrained copies fed a mask token, so drafts past the
first are often rejected and rows accept different lengths (every test asserts partial
acceptance). References are computed without any KV cache.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.drafters.parallel import ParallelDrafter
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_distribution import (
    PROMPT,
    H,
    chi2_pvalue,
    empirical,
    exact_sequence_probs,
    sharp_llama,
)
from tests.decode.test_distribution import models as models
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy

MASK = 2


@pytest.fixture(scope="module")
def pair():
    """A small vocabulary, so drafts past the first are accepted now and then."""
    target = sharp_llama(seed=3, layers=3, scale=6.0)
    return target, truncated_copy(target, 2)


def parallel_cfg(mask: int = MASK, **kw) -> DecoderConfig:
    return DecoderConfig(drafting="parallel", mask_token_id=mask, **kw)


def test_parallel_needs_a_mask_token(pair):
    target, drafter = pair
    with pytest.raises(ConfigError, match="mask_token_id"):
        SpeculativeDecoder(target, drafter, DecoderConfig(drafting="parallel"))
    with pytest.raises(ConfigError, match="decoder.mask_token_id=99"):
        SpeculativeDecoder(target, drafter, DecoderConfig(drafting="parallel", mask_token_id=99))
    with pytest.raises(ConfigError, match="decoder.drafting='pard'"):
        SpeculativeDecoder(target, drafter, DecoderConfig(drafting="pard"))
    drafter.config.mask_token_id = MASK  # an exported parallel drafter carries its mask id
    try:
        dec = SpeculativeDecoder(target, drafter, DecoderConfig(drafting="parallel"))
        assert dec.mask_token_id == MASK
    finally:
        del drafter.config.mask_token_id


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("gamma", [1, 3, 5, 15])  # 15: the deepest round the decoder drafts
def test_parallel_greedy_is_token_identical(pair, gamma, cache):
    target, drafter = pair
    dec = SpeculativeDecoder(
        target, drafter, parallel_cfg(gamma=gamma, max_new_tokens=24, cache=cache)
    )
    drafted = accepted = forwards = 0
    for prompt in prompts(4, 8, seed=gamma):
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        drafted += out.trials
        accepted += out.accepted
        forwards += out.drafter_forwards
        assert out.drafter_forwards == out.target_forwards  # one drafter forward per round
    assert 0 < accepted < drafted
    rows = prompts(4, 8, seed=10 + gamma)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, r, 24) for r in rows]
    assert out.accepted < out.trials


def test_parallel_greedy_accepts_past_the_first_draft(pair):
    target, drafter = pair
    dec = SpeculativeDecoder(target, drafter, parallel_cfg(gamma=4, max_new_tokens=40))
    ids, mask = left_pad(prompts(6, 8, seed=1))
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, r, 40) for r in prompts(6, 8, seed=1)]
    assert out.accepted_at[1] > 0  # mask drafts were accepted: later rounds read a longer lag


@torch.inference_mode()
def brute_force_q(drafter, context: list[int], k: int) -> torch.Tensor:
    """q_1..q_k without a cache: the drafter over context + k-1 masks, softmax at the last k."""
    x = torch.tensor([context + [MASK] * (k - 1)])
    return torch.softmax(drafter(x).logits[0, -k:].float(), -1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("rows", [1, 4])
def test_mask_slots_are_rolled_back(pair, monkeypatch, rows, cache):
    """Every round's q equals a cache-free forward over the row's real tokens + masks: the
    drafter's cache never keeps a mask, and accepted drafts are fed back (batch 1 and batched
    with holes)."""
    target, drafter = pair
    seen = []
    real = ParallelDrafter.propose

    def spy(self, t, pos, k, generator, keep_drafting=None):
        prop = real(self, t, pos, k, generator, keep_drafting)
        seen.append((pos.tolist(), prop.q))
        return prop

    monkeypatch.setattr(ParallelDrafter, "propose", spy)
    dec = SpeculativeDecoder(
        target,
        drafter,
        parallel_cfg(gamma=3, max_new_tokens=20, cache=cache, sampling=Sampling(1.0)),
    )
    prompt_rows = prompts(rows, 8, seed=4)
    ids, mask = left_pad(prompt_rows)
    out = dec.generate(ids, mask, generator=torch.Generator().manual_seed(0))
    assert len(seen) == out.target_forwards > 3
    assert 0 < out.accepted < out.trials
    for positions, q in seen:
        k = q.shape[1]
        for r, p in enumerate(positions):
            seq = prompt_rows[r] + out.tokens[r]
            if p + 1 > len(seq):  # row finished before this round
                continue
            want = brute_force_q(drafter, seq[: p + 1], k)
            torch.testing.assert_close(q[r], want, atol=2e-5, rtol=1e-4)


SETTINGS = [Sampling(1.0), Sampling(0.7, top_p=0.8)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.7-topp0.8"])
def test_parallel_sampling_matches_target_distribution(models, sampling):
    target, drafter = models  # mask id 3: the mask draft overlaps p in both settings
    exact = exact_sequence_probs(target, sampling)
    dec = SpeculativeDecoder(
        target, drafter, parallel_cfg(3, gamma=2, max_new_tokens=H, sampling=sampling)
    )
    n = 8192
    counts = empirical(dec, n, seed=7)
    ids = torch.tensor([PROMPT] * 256)
    probe = dec.generate(ids, torch.ones_like(ids), generator=torch.Generator().manual_seed(1))
    assert 0.05 < probe.alpha < 0.95
    assert probe.accepted_at[1] > 0  # the mask draft is put to the test and sometimes kept
    assert chi2_pvalue(exact, counts, n) > 1e-3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_deep_parallel_rounds_match_target_distribution(models, cache):
    """15 drafts per round (14 masks, more than the 3-token horizon): the sequence law is the
    target's, with mask drafts put to the test and kept."""
    target, drafter = models
    s = Sampling(1.0)
    cfg = parallel_cfg(3, gamma=15, max_draft=15, max_new_tokens=H, sampling=s, cache=cache)
    dec = SpeculativeDecoder(target, drafter, cfg)
    n = 8192
    counts = empirical(dec, n, seed=17)
    ids = torch.tensor([PROMPT] * 256)
    probe = dec.generate(ids, torch.ones_like(ids), generator=torch.Generator().manual_seed(2))
    assert probe.accepted_at[1] > 0 and probe.accepted < probe.trials
    assert chi2_pvalue(exact_sequence_probs(target, s), counts, n) > 1e-3


def test_parallel_lossy_lenience_is_detected(models):
    """The same test has the power to see a wrong rule: lenience 0.3 fails it."""
    target, drafter = models
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target, drafter, parallel_cfg(3, gamma=2, max_new_tokens=H, sampling=s, lenience=0.3)
    )
    n = 8192
    assert chi2_pvalue(exact_sequence_probs(target, s), empirical(dec, n, seed=5), n) < 1e-6


def test_one_drafter_forward_per_round_at_any_gamma():
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=1)
    dec = SpeculativeDecoder(
        target, truncated_copy(target), parallel_cfg(gamma=6, max_new_tokens=30)
    )
    out = dec.generate(torch.tensor([prompts(1, 64, seed=2)[0]]))
    assert out.drafter_forwards == out.target_forwards
    assert out.tokens[0] == greedy_reference(target, prompts(1, 64, seed=2)[0], 30)


def test_bench_parallel_gammas_are_checked():
    from omegaconf import OmegaConf

    from specdistill.decode.bench.draft import parallel_entries

    cfg = OmegaConf.create({"parallel_gammas": [2, 4], "parallel_policies": ["confidence"]})
    assert parallel_entries(cfg) == [2, "2-parallel", 4, "4-parallel", "confidence",
                                     "confidence-parallel"]  # fmt: skip
    for bad in ([], [0], [2, "x"], [True], [16]):
        with pytest.raises(ConfigError, match="^parallel_gammas="):
            parallel_entries(OmegaConf.create({"parallel_gammas": bad}))
    with pytest.raises(ConfigError, match="^parallel_policies="):
        parallel_entries(OmegaConf.create({"parallel_gammas": [2], "parallel_policies": ["x"]}))
