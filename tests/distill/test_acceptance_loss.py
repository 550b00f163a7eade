"""The expected-accepted-length objective (distill.acceptance_loss) against brute force.

p = target, q = drafter (a parallel one: draft d is drawn from q_d alone). The brute force
enumerates every draft sequence y in V^K with its probability prod_d q_d(y_d) and applies the
speculative acceptance rule: draft i is kept with probability min(1, p_i(y_i | y_<i) / q_i(y_i))
given the ones before it were, so a round keeps j drafts or more with probability
prod_{i<=j} r_i. Its expected kept drafts, computed in float64 autograd, must equal the closed
form sum_j prod_{i<=j} a_i in value and gradient (w.r.t. the drafter's logits), and the closed-
form dE/da weights must equal autograd of E.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.acceptance_loss import (
    chain_values,
    expected_accepted,
    length_weights,
    scatter_chain_weights,
    soft_acceptance,
)
from specdistill.distill.parallel import (
    chain_index,
    chains_expected_length,
    check_parallel_config,
    choose_anchors,
    objective_weights,
    pack_parallel,
    round_accepted,
)

V, K = 3, 4
D = torch.float64


def enumerate_round(q_logits: torch.Tensor, p_of) -> torch.Tensor:
    """Exact E[kept drafts] of one round: q_logits (K, V) drafter; p_of(prefix) -> p (V,) the
    target's distribution after the accepted prefix (a tuple of token ids)."""
    q = torch.softmax(q_logits, -1)
    total = torch.zeros((), dtype=D)
    for y in itertools.product(range(V), repeat=K):
        prob = torch.ones((), dtype=D)
        for d, tok in enumerate(y):
            prob = prob * q[d, tok]
        kept, chain = torch.zeros((), dtype=D), torch.ones((), dtype=D)
        for d, tok in enumerate(y):
            p = p_of(y[:d])
            chain = chain * torch.clamp(p[tok] / q[d, tok], max=1.0)
            kept = kept + chain
        total = total + prob * kept
    return total


def random_dist(g: torch.Generator, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(V, generator=g, dtype=D), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_round_matches_enumeration_value_and_gradient(seed):
    """Target distributions per depth that do not depend on the drafted prefix."""
    g = torch.Generator().manual_seed(seed)
    ps = torch.stack([random_dist(g) for _ in range(K)])
    z = torch.randn(K, V, generator=g, dtype=D, requires_grad=True)
    brute = enumerate_round(z, lambda prefix: ps[len(prefix)])
    (g_brute,) = torch.autograd.grad(brute, z)

    lq = torch.log_softmax(z, -1)
    a = soft_acceptance(lq, lp=ps.log())
    closed = expected_accepted(a)
    (g_closed,) = torch.autograd.grad(closed, z)
    assert float(closed.detach()) == pytest.approx(float(brute.detach()), abs=1e-12)
    torch.testing.assert_close(g_closed, g_brute, atol=1e-12, rtol=1e-10)

    # the analytic chain rule: dE/dz = sum_k (dE/da_k) da_k/dz with dE/da = length_weights(a)
    a2 = soft_acceptance(torch.log_softmax(z, -1), lp=ps.log())
    (g_weighted,) = torch.autograd.grad((length_weights(a2) * a2).sum(), z)
    torch.testing.assert_close(g_weighted, g_brute, atol=1e-12, rtol=1e-10)

    # and finite differences of the enumeration itself
    eps, fd = 1e-6, torch.zeros_like(z)
    with torch.no_grad():
        for i in range(K):
            for v in range(V):
                dz = torch.zeros_like(z)
                dz[i, v] = eps
                fd[i, v] = (
                    enumerate_round(z + dz, lambda pre: ps[len(pre)])
                    - enumerate_round(z - dz, lambda pre: ps[len(pre)])
                ) / (2 * eps)
    torch.testing.assert_close(fd, g_brute, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("seed", [3, 4])
def test_greedy_target_round_is_exact_with_prefix_dependent_target(seed):
    """A greedy target (temperature 0) whose argmax depends on the prefix: only the target's
    own path can be accepted, so a_d = q_d(t_d) along it is exact."""
    g = torch.Generator().manual_seed(seed)
    table = {pre: random_dist(g) for n in range(K) for pre in itertools.product(range(V), repeat=n)}

    def p_greedy(prefix):
        return torch.nn.functional.one_hot(table[prefix].argmax(), V).to(D)

    z = torch.randn(K, V, generator=g, dtype=D, requires_grad=True)
    brute = enumerate_round(z, p_greedy)
    (g_brute,) = torch.autograd.grad(brute, z)
    path: list[int] = []
    for _ in range(K):
        path.append(int(table[tuple(path)].argmax()))
    a = soft_acceptance(torch.log_softmax(z, -1), target_ids=torch.tensor(path))
    closed = expected_accepted(a)
    (g_closed,) = torch.autograd.grad(closed, z)
    assert float(closed.detach()) == pytest.approx(float(brute.detach()), abs=1e-12)
    torch.testing.assert_close(g_closed, g_brute, atol=1e-12, rtol=1e-10)
    # and greedy drafting (argmax q) keeps the drafts before the first disagreement
    hard = (z.argmax(-1) == torch.tensor(path)).to(D)
    want = next((i for i, h in enumerate(hard.tolist()) if h == 0), K)
    assert float(expected_accepted(hard)) == want


def test_length_weights_equal_autograd_including_zero_acceptance():
    g = torch.Generator().manual_seed(5)
    a = torch.rand(6, 7, generator=g, dtype=D)
    a[0, 2] = 0.0  # a dead depth: nothing after it counts, but its own weight is P_{k-1} R_k
    a[1, 0] = 0.0
    a.requires_grad_(True)
    (want,) = torch.autograd.grad(expected_accepted(a).sum(), a)
    torch.testing.assert_close(length_weights(a), want, atol=1e-14, rtol=1e-12)
    assert float(length_weights(a)[0, 2]) > 0 and float(length_weights(a)[0, 3]) == 0


def test_weights_favour_rounds_whose_first_draft_is_right():
    """The after-miss effect: a chain the drafter's first draft misses puts almost nothing on
    its deep masks; the same chain with a right first draft puts most of it there."""
    w_miss = length_weights(torch.tensor([0.05, 0.9, 0.9, 0.9], dtype=D))
    w_hit = length_weights(torch.tensor([0.95, 0.9, 0.9, 0.9], dtype=D))
    assert float(w_miss[1:].sum()) < 0.2 * float(w_hit[1:].sum())
    assert float(w_miss[0]) == pytest.approx(float(w_hit[0]))  # depth 1 counts the same


def packed_batch(depth=4):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 30, (2, 10), generator=g)
    att = torch.ones(2, 10, dtype=torch.long)
    att[1, 8:] = 0
    lm = torch.zeros(2, 10, dtype=torch.bool)
    lm[0, 2:9] = True
    lm[1, 4:7] = True
    anchors = choose_anchors(lm, 100)
    return pack_parallel(ids, att, lm, anchors, depth, 1, 0.8), anchors


def test_chain_index_points_at_each_chains_depths():
    packed, anchors = packed_batch()
    index, valid = chain_index(packed)
    assert index.shape == (*anchors.shape, 4)
    for r in range(2):
        for a in range(anchors.shape[1]):
            j = int(anchors[r, a])
            for d in range(4):
                if not bool(valid[r, a, d]):
                    continue
                n = int(index[r, a, d])
                assert int(packed["depth"][r, n]) == d + 1
                assert int(packed["label_pos"][r, n]) == j + d
    assert bool(valid[..., 0][anchors >= 0].all())


def test_chain_terms_match_per_chain_brute_force():
    packed, anchors = packed_batch()
    g = torch.Generator().manual_seed(1)
    accept = torch.rand(packed["weight"].shape, generator=g, dtype=D)
    want_e, want_w = 0.0, torch.zeros_like(accept)
    t = packed["anchors"].shape[1]
    n_real = int((packed["depth"][0] == 1).sum())
    for r in range(2):
        for a in range(t):
            j = int(anchors[r, a])
            if j < 0:
                continue
            slots = [j] + [n_real + a * 3 + i for i in range(3)]
            vals = []
            for s in slots:  # the chain stops at its first depth without a label
                if float(packed["weight"][r, s]) <= 0:
                    break
                vals.append(float(accept[r, s]))
            prefix = 1.0
            for k, v in enumerate(vals):
                prefix *= v
                want_e += prefix
                rest = 1.0
                for later in reversed(vals[k + 1 :]):
                    rest = 1.0 + later * rest
                want_w[r, slots[k]] = (prefix / v if v else 0.0) * rest
    assert float(chains_expected_length(accept, packed)) == pytest.approx(want_e, rel=1e-12)
    total, n = round_accepted(accept, packed)
    assert total == pytest.approx(want_e, rel=1e-12) and n == int((anchors >= 0).sum())
    index, valid = chain_index(packed)
    a_chain, usable = chain_values(accept, index, valid)
    w, hit = scatter_chain_weights(length_weights(a_chain) * usable, index, usable, accept.shape[1])
    torch.testing.assert_close(w[hit], want_w[hit], atol=1e-12, rtol=1e-10)


def test_objective_weights_keep_the_token_total_and_zero_masked_positions():
    packed, _ = packed_batch()
    accept = torch.rand(packed["weight"].shape, generator=torch.Generator().manual_seed(2))
    w = objective_weights(accept, packed)
    assert float(w.sum()) == pytest.approx(float(packed["weight"].sum()), rel=1e-6)
    assert bool((w[packed["weight"] <= 0] == 0).all()) and bool((w[packed["weight"] > 0] > 0).all())


def test_cat_mix_blends_the_cat_and_token_weights():
    packed, _ = packed_batch()
    accept = torch.rand(packed["weight"].shape, generator=torch.Generator().manual_seed(5))
    cat, token = objective_weights(accept, packed), packed["weight"]
    assert torch.equal(objective_weights(accept, packed, 1.0), cat)
    torch.testing.assert_close(objective_weights(accept, packed, 0.0), token)
    mixed = objective_weights(accept, packed, 0.25)
    torch.testing.assert_close(mixed, 0.25 * cat + 0.75 * token)
    assert float(mixed.sum()) == pytest.approx(float(token.sum()), rel=1e-6)
    assert not torch.allclose(cat, token)  # the blend is between two different weightings


def test_round_accepted_counts_drafts_before_the_first_miss():
    packed, anchors = packed_batch()
    agree = torch.ones(packed["weight"].shape)
    index, valid = chain_index(packed)
    r, a = 0, 0
    agree[r, int(index[r, a, 2])] = 0  # chain (0, 0): depths 1, 2 right, depth 3 missed
    total, n = round_accepted(agree, packed)
    usable = torch.cumprod(valid.long(), -1)
    want = float(usable.sum()) - float(usable[r, a, 2:].sum())
    assert total == want and n == int((anchors >= 0).sum())


def test_objective_config_errors_name_the_field():
    ok = {"depth": 15, "anchors": 16, "decay": 0.8, "objective": "cat", "length_weight": 0.5}
    check_parallel_config(ok)
    for key, bad in (
        ("objective", "length"),
        ("length_weight", 0),
        ("depth", 16),
        ("cat_mix", 1.5),
    ):
        with pytest.raises(ConfigError, match=f"parallel.{key}="):
            check_parallel_config(ok | {key: bad})


@pytest.mark.slow  # each: a Seq-KD set, training, per-depth evaluation
@pytest.mark.parametrize(
    ("objective", "topk"), [("acceptance_length", False), ("cat", True)], ids=["al", "cat-topk"]
)
def test_parallel_training_with_the_objective_raises_round_acceptance(
    distill_cfg, tmp_path, request, objective, topk
):
    """The distill stage with parallel.objective: held-out drafts kept per round (measured per
    chain, greedy) rise, and result.json names the objective."""
    from specdistill.distill.train import stage as train

    data = request.getfixturevalue("seqkd_topk_dir" if topk else "seqkd_dir")
    cfg = distill_cfg(
        tmp_path / "run", f"data.path={data}", "drafting=parallel", "parallel.depth=6",
        f"parallel.objective={objective}", "max_steps=12", "eval_every=6",
        "eval.source=target", "eval.sampling.temperature=0",
    )  # fmt: skip
    par = train.run(cfg).parallel
    assert par is not None and par["objective"] == objective
    assert par["round_accepted_best"] > par["round_accepted_before"] + 0.05, par
    assert par["accepted_length_best"] > par["accepted_length_before"]
