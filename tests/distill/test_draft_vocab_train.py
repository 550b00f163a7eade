"""`draft_vocab_train`'s loss: the draft vocabulary as a vocabulary intersection (treatment (b)).

Target p over V = 96 ids (synthetic logits, stored as top-k log-probs), drafter q a tiny Llama
scored over the draft vocabulary SUB (12 ids, unordered) through the distill stage's own
`shared_vocab.shared_vocab_loss`. References: `intersection.tli_loss` over the drafter's FULL head
with d2t identity on SUB and -1 elsewhere (the same q and outcomes, computed without the subset
head), hand-written per-outcome sums, and the held-out acceptance of `evaluate` (with TVD on an
empty tail, the loss is exactly 1 - that acceptance).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.distill.intersection import Intersection, tli_loss
from specdistill.distill.train.evaluate import evaluate
from specdistill.distill.train.logits import masked_logits
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import shared_vocab_loss
from tests.distill.test_intersection import divergence_term

V = 96
SUB = [5, 17, 3, 40, 41, 88, 60, 9, 23, 71, 50, 30]
OUTSIDE = [t for t in range(V) if t not in SUB]
DIVS = [("fkl", 0.0), ("rkl", 1.0), ("tvd", 0.5), ("jsd", 0.5), ("jsd", 0.2)]


def _drafter():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).double().eval()


def _batch(k: int) -> dict[str, torch.Tensor]:
    """3 right-padded rows; the target's top-k at every position, with forced cases at loss
    positions: (0,3) top-1 inside SUB, (0,4) every entry outside, (1,5) every entry inside,
    (1,6) top-1 outside and the second inside. Elsewhere p is random (mixed)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 11), generator=gen)
    att = torch.ones_like(ids)
    att[0, 7:] = 0
    att[2, 9:] = 0
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 3:6] = mask[1, 5:10] = mask[2, 2:8] = True
    logits = torch.randn(3, 11, V, generator=gen, dtype=torch.float64) * 2
    logits[0, 3, SUB[0]] += 12
    logits[0, 4, OUTSIDE[: min(k, 8)]] += 12
    logits[1, 5, SUB[: min(k, 8)]] += 12
    logits[1, 6, OUTSIDE[0]] += 14
    logits[1, 6, SUB[1]] += 12
    top_lp, top_ids = logits.log_softmax(-1).topk(k, -1)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask,
            "topk_ids": top_ids, "topk_lp": top_lp}  # fmt: skip


def _trainer(model, mask_unreachable: bool) -> Any:
    """The fields of trainer.Trainer that `shared_vocab_loss` reads, as `prepare` sets them for
    draft_vocab_train=true (`shared_vocab.train_head_ids`); chunked on, so the test also shows the
    draft vocabulary's head wins over the fused full-head loss."""
    head_ids = torch.tensor(SUB)
    s = SimpleNamespace(loss=SimpleNamespace(temperature=1.0), loss_chunk_size=4,
                        mask_unreachable=mask_unreachable)  # fmt: skip
    return SimpleNamespace(
        model=model, target=None, topk=True, vocab=V, head_ids=head_ids,
        head_inter=Intersection.from_draft_to_target(head_ids, V), chunked=True, s=s,
        accelerator=SimpleNamespace(autocast=contextlib.nullcontext),
    )  # fmt: skip


def _draft_vocab_loss(model, batch, name, beta, mask_unreachable=False, num_tokens=17.0):
    tr = _trainer(model, mask_unreachable)
    return shared_vocab_loss(tr, batch, False, True, name, beta, num_tokens)


def _full_inter() -> Intersection:
    d2t = torch.full((V,), -1, dtype=torch.long)
    d2t[SUB] = torch.tensor(SUB)
    return Intersection.from_draft_to_target(d2t, V)


@pytest.mark.parametrize("mask_unreachable", [False, True])
@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_draft_vocab_loss_is_tli_loss_over_the_full_head(name, beta, mask_unreachable):
    """Value and gradient (every parameter) equal `tli_loss` on the full head's logits with d2t
    identity on the draft vocabulary, -1 elsewhere; head rows outside it get no gradient."""
    model, batch = _drafter(), _batch(k=6)
    params = list(model.parameters())
    got = _draft_vocab_loss(model, batch, name, beta, mask_unreachable)
    g_got = torch.autograd.grad(got, params)
    mask = batch["loss_mask"]
    full = masked_logits(model, batch["input_ids"], batch["attention_mask"], mask, V)
    inter = _full_inter()
    want = tli_loss(
        full, torch.ones(full.shape[0], dtype=torch.bool), inter,
        topk_rows=inter.served_row[batch["topk_ids"][mask]], topk_lp=batch["topk_lp"][mask],
        divergence=name, beta=beta, num_tokens=17.0, mask_unreachable=mask_unreachable,
    )  # fmt: skip
    g_want = torch.autograd.grad(want, params)
    assert torch.isfinite(got) and float(got.detach()) != 0.0
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-10, abs=1e-12)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    head = g_got[-1]  # lm_head.weight [V, H]
    assert bool((head[OUTSIDE] == 0).all()) and bool((head[SUB] != 0).any())


def _hand_b(name: str, beta: float, q: dict[int, float], ids: list[int], lps: list[float]):
    """Treatment (b) on stored top-k by hand: top-k entries in SUB, plus 'the rest in SUB' (p's
    tail, assumed reachable, vs q's mass on SUB off the top-k); entries outside SUB are mass q
    cannot earn: no term, except half of it in TVD."""
    p_k = [math.exp(v) for v in lps]
    pairs = [(pk, q[t]) for t, pk in zip(ids, p_k) if t in q]
    pairs.append((1.0 - sum(p_k), 1.0 - sum(q[t] for t in ids if t in q)))
    total = sum(divergence_term(name, beta, a, b) for a, b in pairs)
    if name == "tvd":
        total += 0.5 * sum(pk for t, pk in zip(ids, p_k) if t not in q)
    return total


@pytest.mark.parametrize(("name", "beta"), DIVS)
def test_draft_vocab_loss_matches_the_hand_written_outcomes(name, beta):
    """Per position (one loss position at a time): the outside entries' mass leaves p's rest
    bucket (the top-k loss's old treatment kept it there, for q to match with mass it has)."""
    model, batch = _drafter(), _batch(k=6)
    mask = batch["loss_mask"]
    with torch.no_grad():
        z = masked_logits(model, batch["input_ids"], batch["attention_mask"], mask, V)
    q_sub = z[:, SUB].softmax(-1)
    for i, (r, c) in enumerate(mask.nonzero().tolist()):
        one = torch.zeros_like(mask)
        one[r, c] = True
        with torch.no_grad():
            got = _draft_vocab_loss(model, {**batch, "loss_mask": one}, name, beta, num_tokens=1)
        q = {t: float(q_sub[i, j]) for j, t in enumerate(SUB)}
        ids, lps = batch["topk_ids"][r, c].tolist(), batch["topk_lp"][r, c].tolist()
        assert float(got) == pytest.approx(_hand_b(name, beta, q, ids, lps), rel=1e-9), (r, c)


def test_tvd_is_one_minus_acceptance_with_an_empty_tail():
    """Stored top-k = all V ids (no tail): per position TVD = 1 - sum_{x in SUB} min(p, q) with q
    the softmax over SUB, and over the rows 1 - the held-out alpha `evaluate` reports for the
    drafter with head_ids at T = 1 (what best/ follows and our decoder serves)."""
    model, batch = _drafter(), _batch(k=V)
    mask = batch["loss_mask"]
    with torch.no_grad():
        z = masked_logits(model, batch["input_ids"], batch["attention_mask"], mask, V)
        accepts = []
        for i, (r, c) in enumerate(mask.nonzero().tolist()):
            one = torch.zeros_like(mask)
            one[r, c] = True
            got = _draft_vocab_loss(model, {**batch, "loss_mask": one}, "tvd", 0.5, num_tokens=1)
            p = dict(zip(batch["topk_ids"][r, c].tolist(), batch["topk_lp"][r, c].exp().tolist()))
            q = z[i, SUB].softmax(-1).tolist()
            accept = sum(min(p[t], qt) for t, qt in zip(SUB, q))
            assert float(got) == pytest.approx(1.0 - accept, rel=1e-9, abs=1e-12), (r, c)
            accepts.append(accept)
        n = int(mask.sum())
        mean = _draft_vocab_loss(model, batch, "tvd", 0.5, num_tokens=n)
        held = evaluate(model, None, [batch], vocab=V, sampling=Sampling(temperature=1.0),
                        head_ids=torch.tensor(SUB))  # fmt: skip
    assert float(mean) == pytest.approx(1.0 - sum(accepts) / n, rel=1e-9)
    assert held["alpha"] == pytest.approx(1.0 - float(mean), rel=1e-6)


@pytest.mark.parametrize(("name", "beta"), [("fkl", 0.0), ("tvd", 0.5)])
def test_greedy_mask_drops_exactly_the_positions_whose_top1_is_outside(name, beta):
    """`mask_unreachable`: the loss equals the unmasked loss over the positions whose stored
    top-1 is in the draft vocabulary (same window count): a top-1 outside with inside entries
    after it (position (1,6)) is dropped, an inside top-1 with outside entries after it kept."""
    model, batch = _drafter(), _batch(k=6)
    mask = batch["loss_mask"]
    inside = torch.isin(batch["topk_ids"][..., 0], torch.tensor(SUB))
    assert bool(inside[0, 3]) and not bool(inside[0, 4]) and not bool(inside[1, 6])
    assert 0 < int((mask & inside).sum()) < int(mask.sum())
    with torch.no_grad():
        masked = _draft_vocab_loss(model, batch, name, beta, mask_unreachable=True)
        kept = _draft_vocab_loss(model, {**batch, "loss_mask": mask & inside}, name, beta)
        dropped = _draft_vocab_loss(model, {**batch, "loss_mask": mask & ~inside}, name, beta)
        every = _draft_vocab_loss(model, batch, name, beta)
    assert float(masked) == pytest.approx(float(kept), rel=1e-12)
    # the dropped positions did carry loss (under (b) FKL a position's value can be negative:
    # m KL(p_I || q) + m log m, with m its reachable mass)
    assert float(dropped) != 0.0 and float(every) == pytest.approx(float(kept + dropped))


@pytest.mark.parametrize(
    ("overrides", "want"),
    [((), False), (("eval.sampling.temperature=0",), True),
     (("tli_mask_unreachable=true",), True),
     (("eval.sampling.temperature=0", "tli_mask_unreachable=false"), False)],
)  # fmt: skip
def test_the_greedy_mask_setting_is_tli_mask_unreachable(distill_cfg, tmp_path, overrides, want):
    """One setting for both intersections (a mapped pair's and the draft vocabulary): auto is on
    exactly when the held-out figure is greedy."""
    s = TrainSettings.from_cfg(distill_cfg(tmp_path, "draft_vocab_train=true", *overrides))
    assert s.mask_unreachable is want


@pytest.mark.parametrize(
    ("value", "rows", "want"),
    [("auto", 49152, False), ("auto", 131072, True), ("auto", 262144, True),
     ("true", 49152, True), ("false", 262144, False)],
)  # fmt: skip
def test_draft_vocab_train_auto_is_on_for_big_heads_only(distill_cfg, tmp_path, value, rows, want):
    """auto trains over the draft vocabulary from 131072 head rows on (Llama 3, Qwen, Gemma),
    where the head is most of a step; SmolLM2's 49k keeps its full head."""
    s = TrainSettings.from_cfg(distill_cfg(tmp_path, f"draft_vocab_train={value}"))
    assert s.trains_draft_vocab(rows) is want
    assert TrainSettings.from_cfg(distill_cfg(tmp_path)).draft_vocab_train == "auto"
