"""Online adaptation's safeguards: the KL anchor to the starting drafter, the gradient
agreement gate and the start-referenced guard, against brute force."""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.distill.losses import distill_loss
from specdistill.distill.online import stage as online
from specdistill.distill.online.buffer import Entry, ReplayBuffer
from specdistill.distill.online.update import (
    Updater,
    buffer_batch,
    buffer_loss,
    gradient_agreement,
)
from tests.distill.test_online import PROMPTS, _decode, _Obj, online_cfg

FKL = _Obj({"name": "fkl", "beta": 0.0})


def _perturbed(drafter, scale: float = 0.5, seed: int = 1):
    """A copy of `drafter` with every weight moved a little (a drafter after some updates)."""
    gen = torch.Generator().manual_seed(seed)
    moved = copy.deepcopy(drafter)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return moved


def test_anchor_term_equals_brute_force_kl_to_the_start_drafter(toy_tiny_pair):
    """buffer_loss(anchor_kl=w) - buffer_loss(anchor_kl=0) = w * mean_t sum_x q0 log(q0/q),
    value and gradient, with the KL written out by hand over the full vocabulary."""
    _, start, tok = toy_tiny_pair
    _, _, entries = _decode(toy_tiny_pair, PROMPTS, record="all", k=8)
    vocab = start.config.vocab_size
    q = _perturbed(start).requires_grad_(True)
    params = list(q.parameters())
    kw = {"vocab": vocab, "loss": FKL, "pad_id": tok.pad_token_id}
    w = 2.5
    with_anchor = buffer_loss(q, entries, anchor=start, anchor_kl=w, **kw)
    plain = buffer_loss(q, entries, **kw)
    g_with = torch.autograd.grad(with_anchor, params)
    g_plain = torch.autograd.grad(plain, params)

    b = buffer_batch(entries, tok.pad_token_id, "cpu")
    sel = (b["rows"], b["cols"])
    logits = q(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[sel]
    with torch.no_grad():
        l0 = start(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[sel]
    n = logits.shape[0]
    brute = logits.new_zeros(())
    for t in range(n):  # the KL written out, position by position
        q0 = torch.softmax(l0[t].double(), -1)
        lq = torch.log_softmax(logits[t].double(), -1)
        brute = brute + (q0 * (q0.log() - lq)).sum()
    brute = brute / n
    g_brute = torch.autograd.grad(brute, params)
    assert float(brute.detach()) > 1e-3  # the perturbed drafter really differs from the start
    torch.testing.assert_close((with_anchor - plain).double(), w * brute, atol=1e-5, rtol=1e-4)
    for a, c, d in zip(g_with, g_plain, g_brute):
        torch.testing.assert_close((a - c).double(), w * d.double(), atol=2e-6, rtol=1e-3)


def test_anchor_is_zero_with_zero_gradient_at_the_start_drafter(toy_tiny_pair):
    _, start, tok = toy_tiny_pair
    _, _, entries = _decode(toy_tiny_pair, PROMPTS, record="all", k=8)
    q = copy.deepcopy(start).requires_grad_(True)
    kw = {"vocab": start.config.vocab_size, "loss": FKL, "pad_id": tok.pad_token_id}
    with_anchor = buffer_loss(q, entries, anchor=start, anchor_kl=3.0, **kw)
    plain = buffer_loss(q, entries, **kw)
    torch.testing.assert_close(with_anchor, plain, atol=1e-6, rtol=0)
    params = list(q.parameters())
    for a, c in zip(torch.autograd.grad(with_anchor, params), torch.autograd.grad(plain, params)):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_fkl_with_anchor_is_fkl_to_the_mixture_of_target_and_start():
    """FKL(p||q) + w KL(q0||q) = (1 + w) KL(m||q) + const(q), m = (p + w q0) / (1 + w): equal
    gradients w.r.t. q's logits (the interpretation in `buffer_loss`'s docstring)."""
    gen = torch.Generator().manual_seed(0)
    n, v, w = 5, 11, 0.7
    lq = torch.randn(1, n, v, generator=gen, dtype=torch.float64, requires_grad=True)
    lp, l0 = (torch.randn(1, n, v, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, n, dtype=torch.bool)
    both = distill_loss(lq, mask, target_logits=lp, divergence="fkl", chunk_size=None)
    both = both + w * distill_loss(lq, mask, target_logits=l0, divergence="fkl", chunk_size=None)
    m = (lp.softmax(-1) + w * l0.softmax(-1)) / (1 + w)
    mixed = (1 + w) * distill_loss(
        lq, mask, target_logits=m.log(), divergence="fkl", chunk_size=None
    )
    (g_both,) = torch.autograd.grad(both, lq)
    (g_mixed,) = torch.autograd.grad(mixed, lq)
    torch.testing.assert_close(g_both, g_mixed)


@pytest.mark.parametrize("compare_frozen", [True, False])
def test_guard_start_rolls_back_below_the_start_drafter_even_after_drift(
    tmp_path, caplog, toy_tiny, compare_frozen
):
    """A perfect drafter (the target, alpha 1) wrecked by an unguarded update (lr 5): the next,
    guarded update is judged against the start drafter's probe alpha (1.0, from the frozen twin
    or a decode of its own), not only against the wrecked pre-update level, so it is undone."""
    cfg = online_cfg(
        tmp_path,
        f"pair.drafter={toy_tiny.target_dir}",
        "optim.optimizer.lr=5.0",
        "guard_every=2",
        "guard_margin=0.0",
        "guard_start=true",
        "gate_agreement=null",  # the wrecking updates must be taken
        f"compare_frozen={str(compare_frozen).lower()}",
    )
    cfg.stream = [{"dataset": "toy-test", "requests": 4}]
    with caplog.at_level("WARNING", logger="specdistill.online"):
        result = online.run(cfg)
    assert result.updates == 2 and result.rollbacks == 1
    assert "update 2 rolled back" in caplog.text and "start drafter 1.000" in caplog.text


def test_gradient_agreement_is_the_cosine_of_the_flattened_gradients():
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    a = [torch.randn(s, generator=gen) for s in shapes]
    b = [torch.randn(s, generator=gen) for s in shapes]
    fa, fb = (torch.cat([x.flatten() for x in g]).double() for g in (a, b))
    brute = float(fa @ fb / (fa.norm() * fb.norm()))
    assert gradient_agreement(a, b) == pytest.approx(brute, abs=1e-12)
    assert gradient_agreement(a, a) == pytest.approx(1.0)
    assert gradient_agreement(a, [-x for x in a]) == pytest.approx(-1.0)
    assert gradient_agreement(a, [torch.zeros(s) for s in shapes]) == 0.0


def test_sample_halves_are_disjoint_seeded_and_need_two_entries():
    buf = ReplayBuffer(1000)
    mk = lambda i: Entry(i, torch.arange(6, dtype=torch.int32), torch.tensor([1, 2]),  # noqa: E731
                         torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3))  # fmt: skip
    assert buf.sample_halves(8, torch.Generator().manual_seed(0)) is None
    buf.add(mk(0))
    assert buf.sample_halves(8, torch.Generator().manual_seed(0)) is None
    for i in range(1, 7):
        buf.add(mk(i))
    a, b = buf.sample_halves(8, torch.Generator().manual_seed(1))
    assert len(a) == len(b) == 3  # 7 entries: at most 3 + 3 distinct ones
    assert not {e.request for e in a} & {e.request for e in b}
    a2, b2 = buf.sample_halves(8, torch.Generator().manual_seed(1))
    assert [e.request for e in a + b] == [e.request for e in a2 + b2]
    a, b = buf.sample_halves(4, torch.Generator().manual_seed(2))
    assert len(a) == len(b) == 2


def _updater(toy_tiny_pair, tmp_path, gate):
    _, start, tok = toy_tiny_pair
    drafter = copy.deepcopy(start).requires_grad_(True)
    cfg = online_cfg(tmp_path, "update_steps=3", "update_batch=2", "optim.optimizer.lr=1e-2")
    cfg.gate_agreement = gate
    return Updater(drafter, cfg, 10, start.config.vocab_size, tok.pad_token_id), drafter


def _changed(model, ref) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_agreement_gate_skips_steps_whose_half_gradients_disagree(toy_tiny_pair, tmp_path):
    """Two different requests: their gradients' cosine is below 1, so gate 1.0 skips every
    step (weights and optimizer untouched), gate -1 takes every step; two copies of the same
    request agree exactly (cos 1) and pass even gate 1.0."""
    _, start, _ = toy_tiny_pair
    _, _, entries = _decode(toy_tiny_pair, PROMPTS, record="all", k=8)
    buf = ReplayBuffer(10_000)
    for e in entries:
        buf.add(e)
    strict, drafter = _updater(toy_tiny_pair, tmp_path, 1.0)
    losses = strict.update(buf, 0)
    assert strict.gated == 3 and len(losses) == 3
    assert not _changed(drafter, start) and not strict.opt.state
    loose, drafter = _updater(toy_tiny_pair, tmp_path, -1.0)
    loose.update(buf, 0)
    assert loose.gated == 0 and _changed(drafter, start)
    same = ReplayBuffer(10_000)
    for i in range(2):
        e = entries[0]
        same.add(Entry(i, e.ids, e.positions, e.topk_ids, e.topk_lp))
    twins, drafter = _updater(toy_tiny_pair, tmp_path, 0.999)
    twins.update(same, 0)
    assert twins.gated == 0 and _changed(drafter, start)


def test_gate_auto_is_strict_for_greedy_and_looser_for_sampling():
    from specdistill.distill.online.config import GATE_GREEDY, GATE_SAMPLING, resolve_gate

    assert resolve_gate("auto", 0.0) == GATE_GREEDY > GATE_SAMPLING == resolve_gate("auto", 1.0)
    assert resolve_gate(None, 0.0) is None and resolve_gate(0.25, 0.0) == 0.25
