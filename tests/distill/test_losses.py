"""Divergences vs float64 brute force (values and gradients), JSD limits, masking, chunking,
accumulation-window normalisation and the top-k (K+1)-way loss."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.distill.losses import (
    distill_loss,
    expected_acceptance,
    token_divergence,
    token_jsd,
)

V = 11


def _brute(name: str, p_logits: torch.Tensor, q_logits: torch.Tensor, beta: float, T: float):
    """Float64, one position at a time, straight from the textbook definitions."""
    out = []
    for pl, ql in zip(p_logits.reshape(-1, V).double(), q_logits.reshape(-1, V).double()):
        p = torch.softmax(pl / T, -1)
        q = torch.softmax(ql / T, -1)
        if name == "fkl":
            d = sum(p[i] * torch.log(p[i] / q[i]) for i in range(V))
        elif name == "rkl":
            d = sum(q[i] * torch.log(q[i] / p[i]) for i in range(V))
        elif name == "tvd":
            d = 0.5 * sum(abs(p[i] - q[i]) for i in range(V))
        else:  # GKD JSD(beta) / (beta (1 - beta)), mixture m = beta p + (1 - beta) q
            m = [beta * p[i] + (1 - beta) * q[i] for i in range(V)]
            kl_pm = sum(p[i] * torch.log(p[i] / m[i]) for i in range(V))
            kl_qm = sum(q[i] * torch.log(q[i] / m[i]) for i in range(V))
            d = (beta * kl_pm + (1 - beta) * kl_qm) / (beta * (1 - beta))
        out.append(d)
    return torch.stack(out).reshape(p_logits.shape[:-1])


def _logits(seed: int, shape=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, V, generator=g) * 2, torch.randn(*shape, V, generator=g) * 2


@pytest.mark.parametrize(
    "name,beta",
    [("fkl", 0.0), ("rkl", 0.0), ("tvd", 0.0), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9)],
)
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_loss_matches_float64_bruteforce_values_and_grads(name, beta, T):
    p_logits, q_logits = _logits(0)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    q = q_logits.clone().requires_grad_(True)
    loss = distill_loss(
        q, mask, target_logits=p_logits, divergence=name, beta=beta, temperature=T, chunk_size=2
    )
    loss.backward()
    q64 = q_logits.double().requires_grad_(True)
    ref = (_brute(name, p_logits, q64, beta, T) * mask).sum() / mask.sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-4, atol=1e-6)
    assert q.grad[~mask].abs().max() == 0  # masked positions get no gradient


def test_jsd_endpoints_are_forward_and_reverse_kl_exactly():
    p_logits, q_logits = _logits(1)
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    fkl = token_divergence("fkl", lp, lq)
    rkl = token_divergence("rkl", lp, lq)
    torch.testing.assert_close(token_jsd(lp, lq, 0.0), fkl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(token_jsd(lp, lq, 1.0), rkl, rtol=1e-6, atol=1e-6)


def test_jsd_is_continuous_near_the_ends():
    p_logits, q_logits = _logits(2)
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    fkl = token_divergence("fkl", lp, lq)
    rkl = token_divergence("rkl", lp, lq)
    betas = (1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
    gaps0 = [(token_jsd(lp, lq, b) - fkl).abs().max().item() for b in betas]
    gaps1 = [(token_jsd(lp, lq, 1 - b) - rkl).abs().max().item() for b in betas]
    for gaps in (gaps0, gaps1):
        # The gap is ~ beta/2 * chi^2 (first order in beta): it shrinks ~10x per decade with no
        # fp32 blow-up as beta -> 0, where a naive KL(q||m)/beta would be all rounding noise.
        for a, b in itertools.pairwise(gaps):
            assert 5 < a / b < 20
        assert gaps[-1] < 1e-3
    # The float64 brute force agrees right next to the ends too.
    for b in (1e-4, 1e-3, 1 - 1e-3, 1 - 1e-4):
        ref = _brute("jsd", p_logits, q_logits, b, 1.0)
        torch.testing.assert_close(token_jsd(lp, lq, b).double(), ref, rtol=1e-4, atol=1e-5)


def test_chunked_equals_unchunked_values_and_gradients():
    p_logits, q_logits = _logits(3, shape=(3, 17))
    mask = torch.rand(3, 17, generator=torch.Generator().manual_seed(0)) > 0.3
    for name in ("fkl", "rkl", "tvd", "jsd"):
        grads, values = [], []
        for chunk in (None, 1, 4, 64):
            q = q_logits.clone().requires_grad_(True)
            loss = distill_loss(q, mask, target_logits=p_logits, divergence=name, chunk_size=chunk)
            (loss * 3.0).backward()  # a non-unit upstream gradient must be propagated
            values.append(loss.item())
            grads.append(q.grad)
        for v, g in zip(values[1:], grads[1:]):
            assert v == pytest.approx(values[0], rel=1e-6)
            torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)


def test_two_microbatches_equal_one_batch_of_the_same_tokens():
    """Window normalisation: grads of 2 micro-batches (each / window tokens) == 1 joint batch."""
    p_logits, q_logits = _logits(4, shape=(4, 9))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[0, :7] = False  # micro-batch 1 has far fewer tokens than micro-batch 2
    mask[1, :5] = False
    n = mask.sum()
    q = q_logits.clone().requires_grad_(True)
    distill_loss(q, mask, target_logits=p_logits, divergence="jsd").backward()
    q2 = q_logits.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        part = distill_loss(
            q2[sl], mask[sl], target_logits=p_logits[sl], divergence="jsd", num_tokens=n
        )
        part.backward()
        total += part.item()
    torch.testing.assert_close(q2.grad, q.grad, rtol=1e-5, atol=1e-8)
    # Per-micro-batch normalisation would give a different (wrong) answer.
    per_mb = sum(
        distill_loss(q_logits[sl], mask[sl], target_logits=p_logits[sl], divergence="jsd").item()
        / 2
        for sl in (slice(0, 2), slice(2, 4))
    )
    full = distill_loss(q_logits, mask, target_logits=p_logits, divergence="jsd").item()
    assert total == pytest.approx(full, rel=1e-6)
    assert abs(per_mb - full) > 1e-3


@pytest.mark.parametrize("name", ["fkl", "rkl", "tvd", "jsd"])
def test_topk_loss_equals_full_loss_when_k_is_v(name):
    p_logits, q_logits = _logits(5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    lp = p_logits.log_softmax(-1)
    top_lp, top_ids = lp.topk(V, dim=-1)
    qa = q_logits.clone().requires_grad_(True)
    qb = q_logits.clone().requires_grad_(True)
    full = distill_loss(qa, mask, target_logits=p_logits, divergence=name, chunk_size=3)
    topk = distill_loss(qb, mask, topk_ids=top_ids, topk_lp=top_lp, divergence=name, chunk_size=3)
    full.backward()
    topk.backward()
    assert topk.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(qb.grad, qa.grad, rtol=1e-4, atol=1e-6)


def test_topk_loss_is_a_lower_bound_and_counts_the_rest_mass():
    p_logits, q_logits = _logits(6)
    mask = torch.ones(2, 5, dtype=torch.bool)
    top_lp, top_ids = p_logits.log_softmax(-1).topk(3, dim=-1)
    full = distill_loss(q_logits, mask, target_logits=p_logits, divergence="fkl").item()
    k3 = distill_loss(q_logits, mask, topk_ids=top_ids, topk_lp=top_lp, divergence="fkl").item()
    # Brute force of the (K+1)-way KL in float64.
    p = p_logits.double().softmax(-1)
    q = q_logits.double().softmax(-1)
    pk, qk = p.gather(-1, top_ids), q.gather(-1, top_ids)
    P = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    Q = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    ref = (P * (P / Q).log()).sum(-1).mean().item()
    assert k3 == pytest.approx(ref, rel=1e-4)
    assert k3 < full


@pytest.mark.parametrize("name,beta", [("fkl", 0.0), ("rkl", 0.0), ("tvd", 0.0), ("jsd", 0.5)])
def test_topk_loss_matches_the_coarse_grained_bruteforce(name, beta):
    """K < V, every divergence: the (K+1)-way loss (top-k tokens + one rest bucket for p and q)
    equals the textbook divergence of the coarse-grained pair in float64, values and grads."""
    p_logits, q_logits = _logits(7)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    k = 4
    top_lp, top_ids = p_logits.log_softmax(-1).topk(k, dim=-1)
    q = q_logits.clone().requires_grad_(True)
    got = distill_loss(q, mask, topk_ids=top_ids, topk_lp=top_lp, divergence=name, beta=beta)
    got.backward()
    q64 = q_logits.double().requires_grad_(True)
    P, Q = p_logits.double().softmax(-1), q64.softmax(-1)
    pk, qk = P.gather(-1, top_ids), Q.gather(-1, top_ids)
    Pc = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    Qc = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    if name == "fkl":
        d = (Pc * (Pc / Qc).log()).sum(-1)
    elif name == "rkl":
        d = (Qc * (Qc / Pc).log()).sum(-1)
    elif name == "tvd":
        d = 0.5 * (Pc - Qc).abs().sum(-1)
    else:
        m = beta * Pc + (1 - beta) * Qc
        kl_pm, kl_qm = (Pc * (Pc / m).log()).sum(-1), (Qc * (Qc / m).log()).sum(-1)
        d = (beta * kl_pm + (1 - beta) * kl_qm) / (beta * (1 - beta))
    ref = (d * mask).sum() / mask.sum()
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-4, atol=1e-7)


def test_expected_acceptance_is_one_minus_tvd():
    p_logits, q_logits = _logits(7)
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    alpha = expected_acceptance(p_logits, q_logits, mask).item()
    tvd = distill_loss(q_logits, mask, target_logits=p_logits, divergence="tvd").item()
    assert alpha == pytest.approx(1 - tvd, rel=1e-6)
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    ref = torch.minimum(p, q).sum(-1)[mask].mean().item()
    assert alpha == pytest.approx(ref, rel=1e-6)
    assert expected_acceptance(p_logits, p_logits, mask).item() == pytest.approx(1.0, rel=1e-6)


def test_bf16_logits_are_computed_in_fp32_and_grad_keeps_dtype():
    p_logits, q_logits = _logits(8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    q = q_logits.bfloat16().requires_grad_(True)
    loss = distill_loss(q, mask, target_logits=p_logits.bfloat16(), chunk_size=2)
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad.dtype == torch.bfloat16
    ref = distill_loss(q.detach().float(), mask, target_logits=p_logits.bfloat16().float())
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
