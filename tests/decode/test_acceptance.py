"""Brute-force checks of every function in specdistill.decode.acceptance (p target, q drafter)."""

from __future__ import annotations

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import (
    acceptance_probs,
    expected_alpha,
    greedy_tokens,
    probs_from_logits,
    process_logits,
    residual,
    sample_from,
    uniforms,
    verify_greedy,
    verify_sampling,
)


def _dist(v: int, seed: int, sharp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(v, generator=g, dtype=torch.float64), -1)


def _brute_kept(probs: list[float], top_k: int, top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        order = order[:top_k]
    kept_probs = [probs[i] for i in order]
    total = sum(kept_probs)
    kept, mass = [], 0.0
    for i, pi in zip(order, kept_probs):
        if mass >= top_p:
            break
        kept.append(i)
        mass += pi / total
    return set(kept)


@pytest.mark.parametrize(
    "top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.7), (0, 0.999), (1, 0.3)]
)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_process_logits_matches_brute_force(temperature, top_k, top_p):
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(20):
        logits = torch.randn(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        probs = torch.softmax(logits / temperature, -1).tolist()
        want = _brute_kept(probs, top_k, top_p)
        got_logits = process_logits(logits[None], s)[0]
        kept = {i for i in range(10) if got_logits[i] > float("-inf")}
        assert kept == want, (seed, kept, want)
        got = probs_from_logits(logits[None], s)[0].double()
        z = sum(probs[i] for i in want)
        for i in range(10):
            assert got[i].item() == pytest.approx(probs[i] / z if i in want else 0.0, abs=1e-6)


def test_greedy_probs_are_one_hot_of_argmax():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    got = probs_from_logits(logits, Sampling(temperature=0.0))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert torch.equal(got.sum(-1), torch.ones(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_are_argmax_ties_and_nans_included(dtype):
    """The decoder's greedy pick is `argmax(-1)` to the index: rows full of ties (the lowest
    index wins), a NaN (it wins), an all -inf row, views with a row offset, vocabularies from a
    handful to SmolLM2's width, and against a Python scan of each row."""
    g = torch.Generator().manual_seed(3)
    for trial, vocab in enumerate([5, 16, 33, 4096, 49152] * 4):
        x = torch.randint(0, 3, (2, 6, vocab), generator=g).to(dtype)  # values 0..2: many ties
        x[0, 0, (7 * trial) % vocab] = float("nan")
        x[1, 1] = float("-inf")
        for v in (x, x[:, 2:], x[1]):
            got = greedy_tokens(v)
            assert torch.equal(got, v.argmax(-1))
        row = x[0, 3].tolist()
        assert int(greedy_tokens(x[0, 3])) == row.index(max(row))
        assert int(greedy_tokens(x[0, 0])) == (7 * trial) % vocab


def test_sample_from_is_inverse_cdf():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    cdf = [0.0, 0.2, 0.2, 0.7, 1.0, 1.0]
    for u in [i / 1000 for i in range(1000)] + [0.999999]:
        want = next(i for i, c in enumerate(cdf) if c > u and probs[i] > 0)
        assert sample_from(probs, torch.tensor(u)).item() == want
    # unnormalised rows and a batch of rows
    batch = torch.tensor([[0.0, 2.0, 2.0], [1.0, 0.0, 0.0]])
    assert sample_from(batch, torch.tensor([0.75, 0.99])).tolist() == [2, 0]
    assert sample_from(batch, torch.tensor([1.0, 1.0])).tolist() == [2, 0]  # never a zero-prob tail


def test_sample_from_matches_a_python_search_and_never_picks_a_zero_token():
    """Random rows with runs of zero-probability tokens (in the middle and at the tail), the
    float32 CDF searched in Python: the first entry above u * total, held below the total; at
    u = 1 and a tail too small to move the float sum, still a token with mass."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        v = int(torch.randint(2, 12, (), generator=gen))
        probs = torch.rand(v, generator=gen) * (torch.rand(v, generator=gen) < 0.6)
        if probs.sum() == 0:
            probs[0] = 1.0
        u = (
            torch.rand((), generator=gen)
            if torch.rand((), generator=gen) < 0.8
            else torch.tensor(1.0)
        )
        cdf = torch.cumsum(probs, 0).tolist()
        point = min(
            float(u) * cdf[-1], float(torch.nextafter(torch.tensor(cdf[-1]), torch.tensor(0.0)))
        )
        want = next(i for i, c in enumerate(cdf) if c > point)
        got = sample_from(probs, u).item()
        assert got == want and probs[got] > 0
    absorbed = torch.tensor([0.5, 0.5, 1e-12, 0.0])  # the last mass does not move the float sum
    assert sample_from(absorbed, torch.tensor(1.0)).item() in (1, 2)


def test_uniforms_are_reproducible_and_in_range():
    a = uniforms((1000,), torch.Generator().manual_seed(3), "cpu")
    b = uniforms((1000,), torch.Generator().manual_seed(3), "cpu")
    assert torch.equal(a, b) and a.min() >= 0 and a.max() < 1 and a.dtype == torch.float32


def test_verify_greedy_matches_python_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, g, v = 3, 4, 3
        logits = torch.randn(b, g + 1, v, generator=gen)
        draft = torch.randint(0, v, (b, g), generator=gen)
        n, nxt = verify_greedy(draft, logits)
        for r in range(b):
            k = 0
            while k < g and draft[r, k] == logits[r, k].argmax():
                k += 1
            assert n[r].item() == k
            assert nxt[r].item() == logits[r, k].argmax().item()


def test_acceptance_probs_and_residual_brute_force():
    p = torch.stack([_dist(6, 1), _dist(6, 2)])[None].float()  # (1, 2, 6)
    q = torch.stack([_dist(6, 3), _dist(6, 4)])[None].float()
    draft = torch.tensor([[2, 5]])
    for lenience in (1.0, 0.5):
        got = acceptance_probs(p, q, draft, lenience)[0]
        for j, x in enumerate([2, 5]):
            want = min(1.0, p[0, j, x].item() / (lenience * q[0, j, x].item()))
            assert got[j].item() == pytest.approx(want, rel=1e-6)
        r = residual(p, q, lenience)[0]
        for j in range(2):
            raw = [max(0.0, p[0, j, i].item() - lenience * q[0, j, i].item()) for i in range(6)]
            z = sum(raw)
            for i in range(6):
                assert r[j, i].item() == pytest.approx(raw[i] / z, abs=1e-6)
    # p == q: nothing left over, residual falls back to p (never reached: acceptance is 1)
    assert torch.allclose(residual(p, p), p)


def _exact_output_distribution(
    p: torch.Tensor, q: torch.Tensor, lenience: float = 1.0
) -> torch.Tensor:
    """P(next emitted token) for one round with G=1, by enumerating drafts and the accept coin."""
    v = p.shape[-1]
    out = torch.zeros(v, dtype=torch.float64)
    for x in range(v):
        if q[0, 0, x] == 0:
            continue
        draft = torch.tensor([[x]])
        a = acceptance_probs(p[:, :1], q, draft, lenience)[0, 0].double()
        out[x] += q[0, 0, x].double() * a
        out += q[0, 0, x].double() * (1 - a) * residual(p[0, 0], q[0, 0], lenience).double()
    return out


@pytest.mark.parametrize("seed", range(5))
def test_speculative_sampling_first_token_is_exactly_p(seed):
    v = 8
    p = torch.stack([_dist(v, seed, 2.0), _dist(v, seed + 100)])[None].float()
    q = _dist(v, seed + 50, 2.0)[None, None].float()
    got = _exact_output_distribution(p, q)
    assert torch.allclose(got, p[0, 0].double(), atol=1e-6)
    # the lossy lenience variant is really lossy (that is why it is off by default)
    assert not torch.allclose(_exact_output_distribution(p, q, 0.3), p[0, 0].double(), atol=1e-3)


def _law_over_grid(draft_probs, p, q, fixed, depth, m=200):
    """Law of the token emitted at `depth` by verify_sampling, integrating the drafts exactly
    (weights q) and the uniforms on independent m-point midpoint grids."""
    v = p.shape[-1]
    grid = (torch.arange(m, dtype=torch.float32) + 0.5) / m
    ua_free, us = torch.cartesian_prod(grid, grid).unbind(-1)  # independent coin and draw
    law = torch.zeros(v, dtype=torch.float64)
    for x in range(v):
        draft = torch.tensor(fixed + [x] + [0] * (q.shape[1] - len(fixed) - 1)).expand(len(us), -1)
        ua = torch.zeros(len(us), q.shape[1])  # coins before `depth`: 0 -> accepted
        ua[:, len(fixed)] = ua_free
        ua[:, len(fixed) + 1 :] = 1.0 - 1e-7  # later coins: reject (irrelevant at `depth`)
        n, nxt = verify_sampling(
            draft, p.expand(len(us), -1, -1), q.expand(len(us), -1, -1), ua, us
        )
        emitted = torch.where(n > depth, draft[:, min(depth, q.shape[1] - 1)], nxt)
        assert bool((n >= depth).all())
        law += draft_probs[x].double() * torch.bincount(emitted, minlength=v).double() / len(us)
    return law


def test_verify_sampling_follows_p_at_every_depth():
    """Given the earlier drafts accepted, the token emitted at depth j follows p_j (drafts ~ q_j)."""
    v, g = 5, 2
    p = torch.stack([_dist(v, 7, 2.0), _dist(v, 8), _dist(v, 9)])[None].float()  # (1, G+1, V)
    q = torch.stack([_dist(v, 10, 2.0), _dist(v, 11)])[None].float()  # (1, G, V)
    for depth in range(g):
        law = _law_over_grid(q[0, depth], p, q, [1] * depth, depth)
        assert torch.allclose(law, p[0, depth].double(), atol=0.01), (depth, law, p[0, depth])
    # All accepted: the bonus token comes from p_G.
    m = 1000
    us = (torch.arange(m, dtype=torch.float32) + 0.5) / m
    draft = torch.tensor([[1, 2]]).expand(m, -1)
    n, nxt = verify_sampling(draft, p.expand(m, -1, -1), q.expand(m, -1, -1), torch.zeros(m, g), us)
    assert bool((n == g).all())
    law = torch.bincount(nxt, minlength=v).double() / m
    assert torch.allclose(law, p[0, g].double(), atol=0.002)


def test_verify_sampling_rows_accept_different_lengths():
    v = 4
    onehot = torch.eye(v)
    # row 0: q == p, always accepted -> bonus from p[2]; row 1: q puts mass where p has none.
    p = torch.stack(
        [
            torch.stack([onehot[1], onehot[2], onehot[3]]),
            torch.stack([onehot[0], onehot[0], onehot[0]]),
        ]
    )
    q = torch.stack([torch.stack([onehot[1], onehot[2]]), torch.stack([onehot[3], onehot[3]])])
    draft = torch.tensor([[1, 2], [3, 3]])
    n, nxt = verify_sampling(draft, p, q, torch.full((2, 2), 0.5), torch.full((2,), 0.5))
    assert n.tolist() == [2, 0] and nxt.tolist() == [3, 0]


def test_expected_alpha_is_one_minus_tvd():
    p, q = _dist(9, 1), _dist(9, 2)
    tvd = 0.5 * (p - q).abs().sum()
    assert expected_alpha(p, q).item() == pytest.approx(1 - tvd.item(), abs=1e-6)
    assert expected_alpha(p, p).item() == pytest.approx(1.0)


def test_uniforms_from_a_host_generator_on_another_device(monkeypatch):
    """The stages seed one CPU generator per run; a CUDA decode must draw on the GPU (torch
    refuses a CPU generator there, which failed a T=1 validate on an H100) from a companion
    generator the host one seeds once. `meta` stands in for the GPU, a host generator for the
    companion it would make."""
    from specdistill.decode import acceptance

    real_rand, made = torch.rand, []

    def fake_new(device):
        made.append((device, torch.Generator()))
        return made[-1][1]

    def strict_rand(shape, *, generator=None, device=None, dtype=None):
        if torch.device(device).type == "meta":
            assert any(generator is g for _, g in made), "drew with the host generator"
            return torch.empty(shape, device="meta", dtype=dtype)
        return real_rand(shape, generator=generator, device=device, dtype=dtype)

    monkeypatch.setattr(acceptance, "_new_generator", fake_new)
    monkeypatch.setattr(acceptance.torch, "rand", strict_rand)
    host = torch.Generator().manual_seed(3)
    for _ in range(3):
        u = acceptance.uniforms((4,), host, "meta")
        assert u.device.type == "meta" and u.shape == (4,)
    assert len(made) == 1 and made[0][0] == torch.device("meta")  # one companion per device
    twin = torch.Generator().manual_seed(3)
    acceptance.uniforms((4,), twin, "meta")
    # seeded by the host: reproducible
    assert made[1][1].initial_seed() == made[0][1].initial_seed()
    # the decode's own device: drawn with the host generator, as before
    here = acceptance.uniforms((4,), torch.Generator().manual_seed(3), "cpu")
    assert torch.equal(here, real_rand((4,), generator=torch.Generator().manual_seed(3)))
