"""The distill stage's speed levers change nothing they claim to keep exact.

- the LM head on loss positions only (`masked_head`) vs the full padded grid;
- stored top-k log-probs with K = V vs the live target;
- `freeze_embeddings` freezes exactly the embeddings and the (tied) head;
- `eval.topk_logprobs: auto` stores top-k with the held-out continuations only where exact.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import logits as lg
from specdistill.distill.train import setup, sources
from specdistill.distill.train import stage as train
from specdistill.distill.train.data import Example
from specdistill.distill.train.settings import TrainSettings
from tests.distill.conftest import make_seqkd


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (3, 11), generator=gen)
    att = torch.ones_like(ids)
    att[0, 7:] = 0  # right padding
    att[2, 9:] = 0
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 3:6] = mask[1, 5:10] = mask[2, 2:8] = True
    return ids, att, mask


@pytest.mark.parametrize("tie", [True, False])
def test_masked_logits_are_the_full_forwards_rows(tie):
    model = _tiny_llama(tie)
    ids, att, mask = _batch()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=att).logits[..., :90][mask]
        got = lg.masked_logits(model, ids, att, mask, 90)
    assert lg.has_plain_head(model) and got.shape == full.shape == (14, 90)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_masked_logits_fall_back_to_the_full_forward_elsewhere():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2)).eval()
    ids, att, mask = _batch()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=att).logits[mask]
        got = lg.masked_logits(model, ids, att, mask, 96)
    assert not lg.has_plain_head(model)
    assert torch.equal(got, full)


def _losses(res) -> list[float]:
    return [h["loss"] for h in res.history]


def test_masked_head_leaves_the_loss_curve_unchanged(distill_cfg, tmp_path, seqkd_dir, one_thread):
    common = (f"data.path={seqkd_dir}", "max_steps=4", "eval_every=4", "save_every=4")
    full = train.run(distill_cfg(tmp_path / "full", *common, "masked_head=false"))
    masked = train.run(distill_cfg(tmp_path / "masked", *common, "masked_head=true"))
    assert len(_losses(full)) == 4
    assert _losses(masked) == pytest.approx(_losses(full), rel=1e-4)
    assert masked.alpha_after == pytest.approx(full.alpha_after, abs=1e-6)
    a, b = (
        load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("full", "masked")
    )
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("data", ["live", "topk"])
@pytest.mark.parametrize("chunked", [False, True])
def test_parallel_masked_head_leaves_the_loss_curve_unchanged(
    distill_cfg, tmp_path, seqkd_dir, seqkd_topk_dir, monkeypatch, one_thread, chunked, data
):
    """drafting=parallel: the head on the packed batch's labelled positions only (as logits or,
    chunked, as hidden states + head) trains exactly like the full packed grid."""
    from specdistill.distill import parallel

    path = seqkd_topk_dir if data == "topk" else seqkd_dir
    common = (f"data.path={path}", "drafting=parallel", "parallel.depth=3", "max_steps=3",
              "eval_every=3", "save_every=3", f"chunked_loss={str(chunked).lower()}")  # fmt: skip
    full = train.run(distill_cfg(tmp_path / "full", *common, "masked_head=false"))

    def no_full_grid(*args, **kwargs):
        raise AssertionError("the masked head ran the full packed grid")

    with monkeypatch.context() as m:
        m.setattr(parallel, "packed_forward", no_full_grid)
        masked = train.run(distill_cfg(tmp_path / "masked", *common, "masked_head=true"))
    assert len(_losses(full)) == 3
    assert _losses(masked) == pytest.approx(_losses(full), rel=1e-4)
    a, b = (
        load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("full", "masked")
    )
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)


@pytest.mark.slow  # a K = V Seq-KD set and two short runs
def test_stored_full_vocab_topk_trains_like_the_live_target(
    distill_cfg, tmp_path, toy_tiny_pair, seqkd_dir, one_thread
):
    """K = V: the (K+1)-way loss on stored log-probs is the full loss, so the run without the
    target follows the run with it step for step (the held-out set is the same for both)."""
    vocab = toy_tiny_pair[0].config.vocab_size
    data = make_seqkd(tmp_path / "topk_all", toy_tiny_pair, n=16, topk=vocab)
    common = (f"data.path={data}", "max_steps=4", "eval_every=4", "save_every=4",
              "eval.source=path", f"eval.path={seqkd_dir}")  # fmt: skip
    live = train.run(distill_cfg(tmp_path / "live", *common, "data.use_topk=false"))
    stored = train.run(distill_cfg(tmp_path / "stored", *common, "data.use_topk=true"))
    assert stored.data["topk"] is True and live.data["topk"] is False
    assert _losses(stored) == pytest.approx(_losses(live), rel=1e-4)
    assert stored.alpha_after == pytest.approx(live.alpha_after, abs=1e-6)


def test_freeze_embeddings_freezes_the_head_and_nothing_else(distill_cfg, tmp_path, seqkd_dir):
    common = (f"data.path={seqkd_dir}", "max_steps=2", "eval_every=2", "save_every=2")
    res = train.run(distill_cfg(tmp_path / "frozen", *common, "freeze_embeddings=true"))
    from specdistill.data.models.pairs import resolve_pair

    before = load_file(f"{resolve_pair({'toy': 'toy-tiny'}).drafter}/model.safetensors")
    after = load_file(str(tmp_path / "frozen" / "final" / "model.safetensors"))
    emb = next(k for k in after if "embed_tokens" in k)
    assert torch.equal(after[emb], before[emb])
    moved = [k for k in after if "layers." in k and not torch.equal(after[k], before[k])]
    assert moved, "the decoder layers must still train"
    assert res.data["frozen_params"] == after[emb].numel()  # tied head: counted once
    auto = train.run(distill_cfg(tmp_path / "auto", *common))  # toy-tiny: not built from layers
    assert auto.data["frozen_params"] == 0


def test_freeze_embeddings_rejects_other_values(distill_cfg, tmp_path):
    with pytest.raises(ConfigError, match="freeze_embeddings"):
        setup.check_config(distill_cfg(tmp_path, "freeze_embeddings=sometimes"))


def test_eval_topk_auto_only_where_stored_logprobs_measure_the_serving_mode(distill_cfg, tmp_path):
    rows = [Example([1, 2], [3], topk_ids=[[3, 4, 5]], topk_logprobs=[[-0.1, -3.0, -4.0]])]

    def settings(*overrides: str) -> TrainSettings:
        return TrainSettings.from_cfg(distill_cfg(tmp_path, *overrides))

    greedy = settings("eval.sampling.temperature=0")
    assert sources.eval_topk(greedy, rows, True) == 3
    assert sources.eval_topk(greedy, rows, False) == 0  # training loads the target anyway
    assert sources.eval_topk(settings("eval.sampling.temperature=1"), rows, True) == 3
    warm = settings("eval.sampling.temperature=0.7")
    assert sources.eval_topk(warm, rows, True) == 0  # stored at T=1: not the serving mode
    assert sources.eval_topk(settings("eval.topk_logprobs=8"), rows, False) == 8
    with pytest.raises(ConfigError, match="eval.topk_logprobs"):
        settings("eval.topk_logprobs=-1")  # checked with the settings, before any load


@pytest.mark.parametrize("plain", [True, False])
def test_draft_vocabulary_head_is_those_columns(plain):
    """head_ids: the head's rows of the subset only, equal to the full logits' columns."""
    if plain:
        model = _tiny_llama(True)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2)).eval()
    ids, att, mask = _batch()
    sub = torch.tensor([5, 90, 0, 17, 33])
    with torch.no_grad():
        full = lg.masked_logits(model, ids, att, mask, 96)
        got = lg.masked_logits(model, ids, att, mask, 96, head_ids=sub)
    torch.testing.assert_close(got, full[:, sub], rtol=1e-5, atol=1e-5)


def test_training_on_the_draft_vocabulary(distill_cfg, tmp_path, toy_tiny_pair, one_thread):
    """distill.draft_vocab=N on stored top-k rows: the drafter's config carries the N ids; with
    draft_vocab_train=true the loss is q over those N (intersection.py's treatment of the
    target's mass outside them; its math: test_draft_vocab_train.py) and falls; the default keeps
    the full head."""
    data = make_seqkd(tmp_path / "topk", toy_tiny_pair, n=16, topk=8)
    common = (f"data.path={data}", "max_steps=6", "eval_every=6", "save_every=6",
              "draft_vocab=64")  # fmt: skip
    sub = train.run(distill_cfg(tmp_path / "sub", *common, "draft_vocab_train=true"))
    full = train.run(distill_cfg(tmp_path / "full", *common))
    assert sub.data["draft_vocab"] == full.data["draft_vocab"] == 64
    assert sub.data["draft_vocab_train"] is True and full.data["draft_vocab_train"] is False
    assert sub.data["tli_mask_unreachable"] is False  # eval.sampling at T = 1: no greedy mask
    losses = _losses(sub)
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    assert _losses(full) != losses  # a different (coarser) objective, not the same numbers
    from transformers import AutoConfig

    assert len(AutoConfig.from_pretrained(sub.drafter_path).draft_vocab_ids) == 64
    with pytest.raises(ConfigError, match="draft_vocab_train="):
        TrainSettings.from_cfg(distill_cfg(tmp_path, "draft_vocab_train=maybe"))


def test_evaluate_with_a_draft_vocabulary_scores_the_subset_argmax():
    """head_ids: q is 0 outside the subset, as our decoder drafts; all ids = no change."""
    from specdistill.data.sampling import Sampling
    from specdistill.distill.train.evaluate import evaluate

    drafter, target = _tiny_llama(True), _tiny_llama(False)
    ids, att, mask = _batch()
    batches = [{"input_ids": ids, "attention_mask": att, "loss_mask": mask}]
    kw = {"vocab": 96, "sampling": Sampling()}
    plain = evaluate(drafter, target, batches, **kw)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    assert evaluate(drafter, target, batches, head_ids=perm, **kw) == plain
    sub = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81])
    got = evaluate(drafter, target, batches, head_ids=sub, **kw)
    with torch.no_grad():
        q = lg.masked_logits(drafter, ids, att, mask, 96)
        p = lg.masked_logits(target, ids, att, mask, 96)
    want = (sub[q[:, sub].argmax(-1)] == p.argmax(-1)).float().mean().item()
    assert got["greedy_agreement"] == pytest.approx(want) and got["alpha"] == pytest.approx(want)
