"""Speculative sampling reproduces the target's sequence distribution (p = target, q = drafter).

Exact sequence probabilities of target-only sampling over a 3-token horizon (vocab 8) are
computed by enumerating every prefix without a cache; the decoder's empirical frequencies are
compared with a chi-square test. The lossy lenience variant must fail the same test, which
shows the test has the power to catch a wrong rule.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from scipy.stats import chisquare

from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import probs_from_logits
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama

V, H, PROMPT = 8, 3, [3, 1, 4]


def sharp_llama(seed: int, layers: int, scale: float = 25.0):
    """Random tiny Llama whose next-token distributions are far from uniform."""
    m = tiny_llama(vocab=V, layers=layers, hidden=16, heads=2, seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


@torch.inference_mode()
def exact_sequence_probs(
    model, sampling: Sampling, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    """P(x_1..x_H | prompt) under target-only sampling, by enumerating all prefixes."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(H):
        prefixes = list(probs)
        logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        step = probs_from_logits(logits, sampling).double()
        probs = {
            (*p, x): probs[p] * step[i, x].item()
            for i, p in enumerate(prefixes)
            for x in range(V)
            if step[i, x] > 0
        }
    return probs


def empirical(
    dec: SpeculativeDecoder, n: int, seed: int, batch: int = 1024
) -> dict[tuple[int, ...], int]:
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    ids = torch.tensor([PROMPT] * batch)
    for _ in range(n // batch):
        for row in dec.generate(ids, torch.ones_like(ids), generator=gen).tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def chi2_pvalue(exact: dict, counts: dict, n: int) -> float:
    """Chi-square over sequences, pooling cells with expected count < 5 into one."""
    assert set(counts) <= set(exact), "sampled a sequence the target gives probability 0"
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * n >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(seq, 0)
            rest_e += p * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


@pytest.fixture(scope="module")
def models():
    target = sharp_llama(seed=11, layers=2)
    drafter = copy.deepcopy(target)  # first layer only, noisy head: close to p, not equal
    drafter.model.layers = drafter.model.layers[:1]
    drafter.config.num_hidden_layers = 1
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.6 * torch.randn(drafter.lm_head.weight.shape, generator=g))
    return target, drafter


SETTINGS = [Sampling(1.0), Sampling(1.0, top_k=3), Sampling(0.7, top_p=0.8)]


@pytest.mark.parametrize("gamma", [1, 2])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "topk3", "t0.7-topp0.8"])
def test_speculative_sampling_matches_target_distribution(models, sampling, gamma):
    target, drafter = models
    exact = exact_sequence_probs(target, sampling)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=gamma, max_new_tokens=H, sampling=sampling)
    )
    n = 8192
    counts = empirical(dec, n, seed=gamma)
    assert 0.05 < counts_alpha(dec, seed=0) < 0.95  # drafter neither useless nor perfect
    assert chi2_pvalue(exact, counts, n) > 1e-3
    # target-only sampling through the same machinery obeys the same law
    base_counts: dict[tuple[int, ...], int] = {}
    gen = torch.Generator().manual_seed(99)
    ids = torch.tensor([PROMPT] * 1024)
    for _ in range(4):
        for row in dec.baseline(ids, torch.ones_like(ids), generator=gen).tokens:
            base_counts[tuple(row)] = base_counts.get(tuple(row), 0) + 1
    assert chi2_pvalue(exact, base_counts, 4096) > 1e-3


def counts_alpha(dec: SpeculativeDecoder, seed: int) -> float:
    ids = torch.tensor([PROMPT] * 256)
    return dec.generate(
        ids, torch.ones_like(ids), generator=torch.Generator().manual_seed(seed)
    ).alpha


def test_lossy_lenience_is_detected(models):
    """Same test, lenience 0.3: the output drifts from p, and the chi-square test sees it."""
    target, drafter = models
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=2, max_new_tokens=H, sampling=s, lenience=0.3)
    )
    assert dec.cfg.lossy
    n = 8192
    assert chi2_pvalue(exact_sequence_probs(target, s), empirical(dec, n, seed=5), n) < 1e-6


def test_exact_probs_cover_the_horizon(models):
    target, _ = models
    exact = exact_sequence_probs(target, Sampling(1.0, top_k=2))
    assert all(len(k) == H for k in exact)
    assert len(exact) <= 2**H and len(exact) < len(list(itertools.product(range(V), repeat=H)))
