"""The fused head loss (distill/head_loss.py) equals the full computation, value and gradients.

The reference is `losses.distill_loss` on the materialised logits h W^T + b (plain autograd,
`chunk_size=None`), in float64, so any difference beyond rounding is a bug in the chunked math:
every divergence, stored top-k and full targets (logits and the target's own head), -100 labels
masked, chunk sizes that do not divide the positions, a trainable and a frozen head.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.head_loss import HeadInput, fused_distill_loss, positions_per_chunk
from specdistill.distill.losses import distill_loss
from specdistill.distill.train import setup, shared_vocab
from specdistill.distill.train import stage as train
from specdistill.distill.train.settings import TrainSettings

N, H, V, K = 23, 12, 997, 7  # V prime: no chunk of rows or positions divides evenly
LOSSES = [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.0), ("jsd", 0.1),
          ("jsd", 0.5), ("jsd", 0.9), ("jsd", 1.0)]  # fmt: skip
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _problem(seed: int = 0, bias: bool = True, train_head: bool = True):
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    h = torch.randn(N, H, generator=gen, dtype=dt).requires_grad_(True)
    w = (torch.randn(V, H, generator=gen, dtype=dt) * 0.7).requires_grad_(train_head)
    b = (torch.randn(V, generator=gen, dtype=dt)).requires_grad_(train_head) if bias else None
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100  # prompt / padding positions
    target = torch.randn(N, V, generator=gen, dtype=dt) * 2.5
    top_lp, top_ids = torch.log_softmax(target, -1).topk(K, -1)
    return h, w, b, labels != -100, target, top_ids, top_lp


def _grads(loss, params):
    return torch.autograd.grad(loss, [p for p in params if p is not None and p.requires_grad])


def _check(ref, got, params):
    torch.testing.assert_close(got, ref, **TOL)
    for gr, gg in zip(_grads(ref, params), _grads(got, params), strict=True):
        torch.testing.assert_close(gg, gr, **TOL)


@pytest.mark.parametrize("name,beta", LOSSES)
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_topk_targets_match_the_full_logits(name, beta, chunk):
    h, w, b, mask, _, ids, lp = _problem()
    kw = {"topk_ids": ids, "topk_lp": lp, "divergence": name, "beta": beta}
    ref = distill_loss(h @ w.T + b, mask, chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h, w, b), mask, chunk_size=chunk, **kw)
    _check(ref, got, (h, w, b))


@pytest.mark.parametrize("name,beta", LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_target_logits_match(name, beta, temperature):
    h, w, b, mask, target, _, _ = _problem(1)
    kw = {"divergence": name, "beta": beta, "temperature": temperature, "target_logits": target}
    ref = distill_loss(h @ w.T + b, mask, chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h, w, b), mask, chunk_size=4, **kw)
    _check(ref, got, (h, w, b))


@pytest.mark.parametrize("name,beta", [("fkl", 0.5), ("tvd", 0.5), ("jsd", 0.3)])
def test_a_live_targets_head_matches_its_logits(name, beta):
    """The target as its own hidden states + head (never materialised either), frozen head."""
    h, w, _, mask, _, _, _ = _problem(2, bias=False, train_head=False)
    gen = torch.Generator().manual_seed(9)
    th = torch.randn(N, 8, generator=gen, dtype=torch.float64)
    tw = torch.randn(V, 8, generator=gen, dtype=torch.float64)
    kw = {"divergence": name, "beta": beta}
    ref = distill_loss(h @ w.T, mask, target_logits=th @ tw.T, chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h, w), mask, target_logits=HeadInput(th, tw), **kw)
    _check(ref, got, (h, w))


def test_weights_batch_dims_and_num_tokens_match():
    """[b, n] leading dims, per-position weights (parallel drafting) and the window's count."""
    h, w, b, mask, _, ids, lp = _problem(3)
    weights = torch.rand(N, dtype=torch.float64)
    kw = {"topk_ids": ids.view(1, N, K), "topk_lp": lp.view(1, N, K), "divergence": "tvd",
          "num_tokens": 40, "weights": weights.view(1, N)}  # fmt: skip
    ref = distill_loss((h @ w.T + b).view(1, N, V), mask.view(1, N), chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h.view(1, N, H), w, b), mask.view(1, N), **kw)
    _check(ref, got, (h, w, b))


def test_rest_bucket_without_cancellation_and_k_equal_v():
    """A top-k with almost all of q's mass (rest ~e^-60, lost by 1 - sum in float64) and K = V
    (an empty rest: its log-prob is the floor, its gradient zero) both match."""
    h, w, b, mask, target, _, _ = _problem(4)
    z = (h @ w.T + b).detach()
    hot = z.topk(K, -1).indices
    b_hot = b.detach().clone()
    b_hot[hot.flatten()] += 60.0  # those rows dominate q everywhere
    b_hot.requires_grad_(True)
    lp, ids = torch.log_softmax(target, -1).topk(K, -1)
    ids = torch.cat([hot[:, :1], ids[:, 1:]], -1)
    for top_ids, top_lp in ((ids, lp), (torch.log_softmax(target, -1).topk(V, -1)[::-1])):
        kw = {"topk_ids": top_ids, "topk_lp": top_lp, "divergence": "rkl"}
        ref = distill_loss(h @ w.T + b_hot, mask, chunk_size=None, **kw)
        got = fused_distill_loss(HeadInput(h, w, b_hot), mask, chunk_size=3, **kw)
        _check(ref, got, (h, w, b_hot))


def test_duplicate_topk_ids_match():
    """Rows that repeat an id (a short top-k padded with its last id) are counted as autograd
    counts them: the gradient sums over repeats, the normaliser's term once."""
    h, w, b, mask, _, ids, lp = _problem(5)
    ids = ids.clone()
    ids[:, -2:] = ids[:, -3:-2]
    kw = {"topk_ids": ids, "topk_lp": lp, "divergence": "fkl"}
    ref = distill_loss(h @ w.T + b, mask, chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h, w, b), mask, chunk_size=6, **kw)
    _check(ref, got, (h, w, b))


def test_no_grad_and_fp32_paths():
    h, w, b, mask, _, ids, lp = _problem(6)
    kw = {"topk_ids": ids, "topk_lp": lp, "divergence": "jsd"}
    with torch.no_grad():
        ref = distill_loss(h @ w.T + b, mask, chunk_size=None, **kw)
        got = fused_distill_loss(HeadInput(h, w, b), mask, **kw)
    torch.testing.assert_close(got, ref, **TOL)
    h32, w32 = h.detach().float().requires_grad_(True), w.detach().float()
    ref = distill_loss(h32 @ w32.T, mask, chunk_size=None, **kw)
    got = fused_distill_loss(HeadInput(h32, w32), mask, **kw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grads(got, (h32,))[0], _grads(ref, (h32,))[0], rtol=1e-4,
                               atol=1e-7)  # fmt: skip


def test_positions_per_chunk_holds_the_budget():
    assert positions_per_chunk(262144, 1024, 1 << 24) == 64
    assert positions_per_chunk(1 << 30, 10) == 1
    assert positions_per_chunk(96, 10) == 10


def test_chunked_loss_setting(distill_cfg, tmp_path):
    s = TrainSettings.from_cfg(distill_cfg(tmp_path))
    assert s.use_chunked_loss(49152) and not s.use_chunked_loss(4096)  # auto
    with pytest.raises(ConfigError, match=r"^chunked_loss='sometimes': use auto, true or false"):
        setup.check_config(distill_cfg(tmp_path, "chunked_loss=sometimes"))


@pytest.mark.parametrize("extra", [(), ("lmbda=1", "onpolicy.max_new_tokens=4")])
def test_the_stage_trains_alike_with_the_fused_loss(
    distill_cfg, tmp_path, seqkd_topk_dir, one_thread, extra, monkeypatch
):
    """Stored top-k rows (and on-policy rows against the live target's head): the same loss
    curve and held-out alpha with chunked_loss=true as with false (fp32: rounding only)."""
    calls = []

    def counted(student, *args, **kwargs):
        calls.append(type(kwargs.get("target_logits")).__name__)
        return fused_distill_loss(student, *args, **kwargs)

    monkeypatch.setattr(shared_vocab, "fused_distill_loss", counted)
    common = (f"data.path={seqkd_topk_dir}", "max_steps=3", "eval_every=3", "save_every=3",
              "freeze_embeddings=false", *extra)  # fmt: skip
    runs = [train.run(distill_cfg(tmp_path / str(on), *common, f"chunked_loss={on}"))
            for on in ("false", "true")]  # fmt: skip
    off, on = ([h["loss"] for h in r.history] for r in runs)
    assert len(on) == 3 and on == pytest.approx(off, rel=1e-4)
    assert runs[1].alpha_after == pytest.approx(runs[0].alpha_after, abs=1e-4)
    assert calls and set(calls) == {"HeadInput" if extra else "NoneType"}  # the fused path ran


def test_the_vocab_bench_times_the_stage_paths(one_thread):
    """bench/vocab.py's configurations run (small here): before and after give the same loss
    values, the draft-vocabulary path trains that many rows, and the table prints the ratios."""
    from argparse import Namespace

    from specdistill.distill.bench import vocab as bench

    args = Namespace(threads=1, layers=1, hidden=72, rows=2, prompt=4, completion=6, topk=4,
                     loss="tvd", steps=1)  # fmt: skip
    rows = [bench.measure(v, p, args) for v in (512, 1024) for p in ("before", "after")]
    rows.append(bench.measure(1024, "draft:128", args))
    for before, after in (rows[0:2], rows[2:4]):
        assert after["losses"] == pytest.approx(before["losses"], rel=1e-5)
    assert rows[-1]["head_rows"] == 128 and rows[-1]["losses"] != rows[3]["losses"]
    table = "\n".join(bench._table(rows))
    assert "tokens/s 1024 after / 512 after" in table and "1024 draft:128 / 512 before" in table
    # the stage's default path by vocabulary: what the "stage's defaults" ratio compares
    got = {v: bench.default_variant(v) for v in (1024, 49152, 131072, 262144)}
    assert got == {1024: "before", 49152: "after", 131072: "draft:4096", 262144: "draft:4096"}
