"""The TLI loss and acceptance (distill/intersection.py) against brute force on small vocabularies,
and the treatment of the target's mass outside the intersection against a grid search over q.

Target p over 5 target ids, drafter q over its own rows; I = {0, 1, 2} in target ids, target ids
3 and 4 outside. Brute force is written per outcome with Python loops, independent of the code.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdistill.distill import intersection as tli
from specdistill.distill.losses import token_divergence


@pytest.fixture(autouse=True)
def _float64():
    """float64 throughout (brute force to 1e-12), restored after each test."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


VT = 5
# Drafter rows: 0 -> t0, 1 and 2 -> t1 (many-to-one), 3 -> t2, 4 unmapped.
D2T_MANY = torch.tensor([0, 1, 1, 2, -1])
# A permuted one-to-one drafter: rows 0 -> t2, 1 none, 2 -> t0, 3 -> t1.
D2T_ONE = torch.tensor([2, -1, 0, 1])
DIVS = [("fkl", 0.0), ("rkl", 1.0), ("tvd", 0.5), ("jsd", 0.5), ("jsd", 0.2)]


def brute_q(z: list[float], d2t: list[int]) -> list[float]:
    """Served q over target ids: softmax over mapped rows, rows of one id summed."""
    rows = [r for r, t in enumerate(d2t) if t >= 0]
    norm = sum(math.exp(z[r]) for r in rows)
    q = [0.0] * VT
    for r in rows:
        q[d2t[r]] += math.exp(z[r]) / norm
    return q


def divergence_term(name: str, beta: float, a: float, b: float) -> float:
    """One outcome's term of the divergence between p's mass a and q's mass b, by hand."""
    if name == "fkl":
        return a * math.log(a / b)
    if name == "rkl":
        return b * math.log(b / a)
    if name == "tvd":
        return 0.5 * abs(a - b)
    m = beta * a + (1 - beta) * b
    return a * math.log(a / m) / (1 - beta) + b * math.log(b / m) / beta


def brute_loss(name: str, beta: float, p: list[float], q: list[float], inside: set[int]) -> float:
    """Treatment (b): terms over I with raw p; TVD adds half the outside mass."""
    total = sum(divergence_term(name, beta, p[x], q[x]) for x in inside)
    if name == "tvd":
        total += 0.5 * sum(p[x] for x in range(VT) if x not in inside)
    return total


def _inside(d2t: torch.Tensor) -> set[int]:
    return {int(t) for t in d2t if t >= 0}


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 5, generator=gen)  # [b, n, Vd] (the one-to-one drafter uses 4 rows)
    t = torch.randn(2, 3, VT, generator=gen) * 2
    return z, t


def test_intersection_indices():
    inter = tli.Intersection.from_draft_to_target(D2T_MANY, VT)
    assert inter.slot_ids.tolist() == [0, 1, 2] and not inter.one_to_one
    assert inter.target_slot.tolist() == [0, 1, 2, -1, -1]
    assert inter.served_row.tolist() == [0, 1, 3, -1, -1]  # the first of rows 1, 2
    one = tli.Intersection.from_draft_to_target(D2T_ONE, VT)
    assert one.one_to_one and one.served_row.tolist() == [2, 3, 0, -1, -1]
    with pytest.raises(ValueError, match="I is empty"):
        tli.Intersection.from_draft_to_target(torch.tensor([-1, -1]), VT)


@pytest.mark.parametrize("d2t", [D2T_MANY, D2T_ONE], ids=["many-to-one", "one-to-one"])
def test_served_q_matches_brute_force(d2t, batch):
    z = batch[0][..., : d2t.numel()]
    inter = tli.Intersection.from_draft_to_target(d2t, VT)
    logits = tli.served_target_logits(z, inter, VT)
    for i, j in itertools.product(range(2), range(3)):
        want = brute_q(z[i, j].tolist(), d2t.tolist())
        assert logits[i, j].exp().tolist() == pytest.approx(want, abs=1e-12)
        assert int(tli.served_argmax(z[i, j], inter)) == max(range(VT), key=lambda x: want[x])


@pytest.mark.parametrize("d2t", [D2T_MANY, D2T_ONE], ids=["many-to-one", "one-to-one"])
@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_live_loss_value_and_gradient_match_brute_force(d2t, name, beta, batch):
    z, t = batch[0][..., : d2t.numel()], batch[1]
    inter = tli.Intersection.from_draft_to_target(d2t, VT)
    mask = torch.tensor([[True, True, False], [True, False, True]])

    def brute(zz: torch.Tensor) -> float:
        total = 0.0
        for i, j in itertools.product(range(2), range(3)):
            if mask[i, j]:
                p = torch.softmax(t[i, j], -1).tolist()
                total += brute_loss(name, beta, p, brute_q(zz[i, j].tolist(), d2t.tolist()),
                                    _inside(d2t))  # fmt: skip
        return total / 7.0

    zg = z.clone().requires_grad_(True)
    loss = tli.tli_loss(zg, mask, inter, target_logits=t, divergence=name, beta=beta,
                        num_tokens=7.0)  # fmt: skip
    assert float(loss.detach()) == pytest.approx(brute(z), abs=1e-10)
    (grad,) = torch.autograd.grad(loss, zg)
    eps = 1e-6
    for idx in itertools.product(range(2), range(3), range(z.shape[-1])):
        up, down = z.clone(), z.clone()
        up[idx] += eps
        down[idx] -= eps
        fd = (brute(up) - brute(down)) / (2 * eps)
        assert float(grad[idx]) == pytest.approx(fd, abs=1e-6), idx


@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_topk_loss_matches_brute_force(name, beta, batch):
    """K = 3 stored ids per position (some outside I): outcomes = the stored ids in I, the rest
    in I (p's tail vs q's mass on I off the top-k); stored ids outside I join the outside mass."""
    z, t = batch
    inter = tli.Intersection.from_draft_to_target(D2T_MANY, VT)
    lp_full = torch.log_softmax(t, -1)
    lp_k, ids = lp_full.topk(3, -1)
    rows = inter.served_row[ids]
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss = tli.tli_loss(z, mask, inter, topk_rows=rows, topk_lp=lp_k, divergence=name,
                        beta=beta, num_tokens=1.0)  # fmt: skip
    want = 0.0
    for i, j in itertools.product(range(2), range(3)):
        q = brute_q(z[i, j].tolist(), D2T_MANY.tolist())
        top = ids[i, j].tolist()
        p = lp_full[i, j].exp().tolist()
        inside = [x for x in top if x in (0, 1, 2)]
        # the coarse pair: stored ids in I, the rest in I, and the outside outcome
        cp = [p[x] for x in inside] + [1 - sum(p[x] for x in top)]
        cq = [q[x] for x in inside] + [1 - sum(q[x] for x in inside)]
        out = sum(p[x] for x in top if x not in (0, 1, 2))
        coarse = cp + [out] + [0.0] * (VT - len(cp) - 1)
        cq_full = cq + [0.0] * (VT - len(cq))
        want += brute_loss(name, beta, coarse, cq_full, set(range(len(cp))))
    assert float(loss) == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_topk_with_every_id_stored_equals_the_live_loss(name, beta, batch):
    z, t = batch
    inter = tli.Intersection.from_draft_to_target(D2T_MANY, VT)
    lp, ids = torch.log_softmax(t, -1).topk(VT, -1)
    mask = torch.ones(2, 3, dtype=torch.bool)
    kw = {"divergence": name, "beta": beta}
    live = tli.tli_loss(z, mask, inter, target_logits=t, **kw)
    stored = tli.tli_loss(z, mask, inter, topk_rows=inter.served_row[ids], topk_lp=lp, **kw)
    assert float(stored) == pytest.approx(float(live), abs=1e-10)


@pytest.mark.parametrize("mask_unreachable", [False, True])
@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_chunked_loss_equals_unchunked(name, beta, mask_unreachable, batch):
    """`chunk_size` (positions per chunk, gradient per chunk): the same value and gradient as
    plain autograd, for live and stored top-k targets, with and without the greedy mask."""
    z, t = batch
    inter = tli.Intersection.from_draft_to_target(D2T_MANY, VT)
    lp, ids = torch.log_softmax(t, -1).topk(3, -1)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    kw = {"divergence": name, "beta": beta, "mask_unreachable": mask_unreachable}
    for target in ({"target_logits": t}, {"topk_rows": inter.served_row[ids], "topk_lp": lp}):
        got = []
        for chunk in (None, 1, 2, 8):
            zg = z.clone().requires_grad_(True)
            loss = tli.tli_loss(zg, mask, inter, chunk_size=chunk, **target, **kw)
            got.append((float(loss.detach()), torch.autograd.grad(loss, zg)[0]))
        for value, grad in got[1:]:
            assert value == pytest.approx(got[0][0], abs=1e-12)
            torch.testing.assert_close(grad, got[0][1], rtol=1e-12, atol=1e-12)


def test_acceptance_matches_brute_force(batch):
    z, t = batch
    inter = tli.Intersection.from_draft_to_target(D2T_MANY, VT)
    samp = tli.tli_acceptance_full(z, t, inter, greedy=False)
    greedy = tli.tli_acceptance_full(z, t, inter, greedy=True)
    lp, ids = torch.log_softmax(t, -1).topk(VT, -1)
    rows = inter.served_row[ids]
    for i, j in itertools.product(range(2), range(3)):
        q, p = brute_q(z[i, j].tolist(), D2T_MANY.tolist()), torch.softmax(t[i, j], -1).tolist()
        assert float(samp[i, j]) == pytest.approx(sum(min(a, b) for a, b in zip(p, q)), abs=1e-12)
        top_p, top_q = max(range(VT), key=p.__getitem__), max(range(VT), key=q.__getitem__)
        assert float(greedy[i, j]) == float(top_p == top_q)
    # stored top-k: exact for greedy, and for sampling when every id is stored
    assert torch.equal(tli.tli_acceptance_topk(z, rows, lp, inter, greedy=True), greedy)
    assert torch.allclose(tli.tli_acceptance_topk(z, rows, lp, inter, greedy=False), samp)


# ------------------------------------------------------------------- the treatment, by grid search

ONE = tli.Intersection.from_draft_to_target(torch.tensor([0, 1, 2]), VT)  # q over I's 3 slots


def _grid(step: int = 100) -> torch.Tensor:
    """Every q on the simplex over I's 3 slots with masses k/step, all > 0, as logits."""
    pts = [(a, b, step - a - b) for a in range(1, step) for b in range(1, step - a)]
    return torch.tensor(pts, dtype=torch.float64).div(step).log()


def _accept(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return tli.tli_acceptance_full(z, p.log().expand(z.shape[0], VT), ONE, greedy=False)


def _loss_b(name: str, beta: float, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    o = tli.full_outcomes(z, p.log().expand(z.shape[0], VT), ONE)
    return tli.tli_divergence(name, o, beta)


def _loss_a(name: str, beta: float, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Treatment (a): p renormalised over I, the divergence over I's slots."""
    p_in = p[:3] / p[:3].sum()
    return token_divergence(name, p_in.log().expand(z.shape[0], 3), torch.log_softmax(z, -1), beta)


def test_tvd_under_b_is_exactly_one_minus_acceptance():
    z = _grid(20)
    p = torch.tensor([0.2, 0.1, 0.15, 0.4, 0.15])
    assert torch.allclose(_loss_b("tvd", 0.5, z, p), 1 - _accept(z, p), atol=1e-12)


@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_one_position_every_divergence_is_minimised_at_max_acceptance(name, beta):
    """One position, q free over I: acceptance is at most m = p(I); each (b) loss's grid
    minimiser reaches it, and the acceptance-optimal set is larger than renormalised p."""
    p = torch.tensor([0.2, 0.1, 0.15, 0.4, 0.15])  # m = 0.45, argmax outside I
    z = _grid()
    acc = _accept(z, p)
    assert float(acc.max()) == pytest.approx(0.45, abs=1e-12)
    best = int(_loss_b(name, beta, z, p).argmin())
    assert float(acc[best]) == pytest.approx(0.45, abs=1e-12)
    # q = (0.6, 0.2, 0.2) is as good as p_I = (0.44, 0.22, 0.33): TVD(b) cannot tell them apart.
    other = torch.tensor([[0.6, 0.2, 0.2]]).log()
    assert float(_accept(other, p)) == pytest.approx(0.45)
    tvd = _loss_b("tvd", 0.5, torch.cat([other, p[:3].log()[None]]), p)
    assert float(tvd[0]) == pytest.approx(float(tvd[1]))


# Positions sharing one q (a drafter that cannot tell their contexts apart): P1 twice, with
# only 10% of its mass in I (its argmax outside), and P2 once, all but 2% in I.
P1 = torch.tensor([0.08, 0.01, 0.01, 0.5, 0.4], dtype=torch.float64)
P2 = torch.tensor([0.30, 0.65, 0.03, 0.01, 0.01], dtype=torch.float64)
SHARED = [(P1, 2.0), (P2, 1.0)]


def _total(fn, z: torch.Tensor, positions=SHARED) -> torch.Tensor:
    return sum(w * fn(z, p) for p, w in positions)


def _greedy(z: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(z.shape[0], dtype=torch.bool)
    return sum(
        w * tli.tli_acceptance_full(z, p.log().expand(z.shape[0], VT), ONE, greedy=True) * ones
        for p, w in SHARED
    )


def test_shared_q_b_keeps_the_acceptance_that_a_loses():
    """With positions competing for q, (b)-TVD's minimiser is the acceptance maximiser; (b)-FKL
    weighs P1 by its reachable mass 0.1 and keeps most of the acceptance; (a) weighs P1 fully
    and loses it (FKL and TVD alike)."""
    z = _grid()
    acc = _total(_accept, z)
    best = float(acc.max())

    def acc_at_min(fn) -> float:
        return float(acc[int(_total(fn, z).argmin())])

    tvd_b = acc_at_min(lambda zz, p: _loss_b("tvd", 0.5, zz, p))
    fkl_b = acc_at_min(lambda zz, p: _loss_b("fkl", 0.0, zz, p))
    fkl_a = acc_at_min(lambda zz, p: _loss_a("fkl", 0.0, zz, p))
    tvd_a = acc_at_min(lambda zz, p: _loss_a("tvd", 0.5, zz, p))
    jsd_b = acc_at_min(lambda zz, p: _loss_b("jsd", 0.5, zz, p))
    jsd_a = acc_at_min(lambda zz, p: _loss_a("jsd", 0.5, zz, p))
    assert tvd_b == pytest.approx(best, abs=1e-12)
    assert fkl_b > fkl_a + 0.2 and jsd_b > jsd_a + 0.1, (fkl_b, fkl_a, jsd_b, jsd_a)
    assert tvd_a < best - 0.3, (tvd_a, best)


def test_greedy_positions_whose_argmax_is_outside_never_count():
    """Greedy: P1's argmax is outside I, so no q is ever accepted there; masking it
    (`mask_unreachable`) leaves P2's argmax to q, while (a) without the mask drafts P1's
    in-I favourite and loses P2 too."""
    z = _grid(30)  # tli_loss itself per grid point: a coarser grid
    greedy = _greedy(z)
    assert float(greedy.max()) == 1.0  # only P2 can ever be accepted
    t = torch.stack([P1, P1, P2]).log()
    masked = torch.stack(
        [
            tli.tli_loss(
                zz.expand(3, 3),
                torch.ones(3, dtype=torch.bool),
                ONE,
                target_logits=t,
                divergence="fkl",
                mask_unreachable=True,
            )
            for zz in z
        ]
    )
    assert float(greedy[int(masked.argmin())]) == 1.0
    fkl_a = _total(lambda zz, p: _loss_a("fkl", 0.0, zz, p), z)
    assert float(greedy[int(fkl_a.argmin())]) == 0.0
    o = tli.full_outcomes(z[:1].expand(3, 3), t, ONE)
    assert o.reachable.tolist() == [False, False, True]
