"""A parallel drafter built from the target's layers trains only its mask token's embedding row
(distill/train/mask_row.py): the frozen head's logits are kept exactly, the checkpoint it writes
is a plain untied model that reloads to the same logits, and a run changes that row alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from specdistill.distill.train import mask_row
from specdistill.distill.train import stage as train
from tests.conftest import tiny_llama
from tests.distill.conftest import Crash, crash_after

MASK = 5


def _tied_llama() -> LlamaForCausalLM:
    return tiny_llama(vocab=48, layers=1, hidden=16, heads=2, kv_heads=1, tie=True)


def _ids() -> torch.Tensor:
    return torch.tensor([[3, 7, MASK, 9, MASK, 11]])


def test_only_the_mask_row_trains_and_the_head_keeps_its_logits(tmp_path):
    model = _tied_llama()
    before = model(_ids()).logits.detach()
    original = model.get_input_embeddings().weight.detach().clone()
    frozen = mask_row.train_mask_row_only(model, MASK)
    assert frozen == original.numel()  # the untied head's copy counted once, as when tied
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.embed_tokens.mask_row" in trainable
    assert not {n for n in trainable if "embed_tokens.weight" in n or n.startswith("lm_head")}
    torch.testing.assert_close(model(_ids()).logits, before, rtol=0, atol=0)
    with torch.no_grad():  # the row learns: inputs at the mask move, the head does not
        model.get_input_embeddings().mask_row.add_(torch.randn(16))
    after = model(_ids()).logits.detach()
    assert not torch.allclose(after[0, 2:], before[0, 2:])
    torch.testing.assert_close(after[0, :2], before[0, :2], rtol=0, atol=0)
    assert torch.equal(model.get_output_embeddings().weight, original)

    state = mask_row.plain_state_dict(model, dict(model.state_dict()))
    assert "model.embed_tokens.mask_row" not in state
    model.save_pretrained(str(tmp_path), state_dict=state, safe_serialization=True)
    assert AutoConfig.from_pretrained(tmp_path).tie_word_embeddings is False
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["lm_head.weight"], original)
    changed = (saved["model.embed_tokens.weight"] != original).any(-1)
    assert changed.nonzero().flatten().tolist() == [MASK]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(_ids()).logits, after, rtol=1e-6, atol=1e-6)


def test_a_parallel_run_with_frozen_embeddings_changes_the_mask_row_alone(
    distill_cfg, tmp_path, seqkd_dir, toy_tiny_pair
):
    res = train.run(distill_cfg(
        tmp_path / "run", f"data.path={seqkd_dir}", "drafting=parallel", "parallel.depth=3",
        "freeze_embeddings=true", "max_steps=3", "eval_every=3", "save_every=3",
    ))  # fmt: skip
    drafter = toy_tiny_pair[1]
    base = drafter.get_input_embeddings().weight.detach()
    tied = drafter.config.tie_word_embeddings
    frozen = json.loads((tmp_path / "run" / "result.json").read_text())["data"]["frozen_params"]
    assert frozen == base.numel() * (1 if tied else 2)
    mask = res.parallel["mask_token_id"]
    saved = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    emb = saved["model.embed_tokens.weight"]
    assert ((emb != base).any(-1)).nonzero().flatten().tolist() == [mask]
    assert torch.equal(saved["lm_head.weight"], drafter.get_output_embeddings().weight)
    layers = [k for k in saved if ".layers." in k]
    assert any(not torch.equal(saved[k], drafter.state_dict()[k]) for k in layers)


def test_the_mask_row_is_made_trainable_once():
    model = _tied_llama()
    mask_row.train_mask_row_only(model, MASK)
    with pytest.raises(ValueError, match="already trainable"):
        mask_row.train_mask_row_only(model, MASK)


def test_a_killed_parallel_run_resumes_with_its_mask_row(
    distill_cfg, tmp_path, seqkd_dir, monkeypatch
):
    """The resume checkpoint keeps the trainable row (and its AdamW moments) as it trains."""
    common = (f"data.path={seqkd_dir}", "drafting=parallel", "parallel.depth=3",
              "freeze_embeddings=true", "max_steps=4", "save_every=2", "eval_every=4")  # fmt: skip
    ref = train.run(distill_cfg(tmp_path / "ref", *common))
    # killed after step 3, whose checkpoint was never written (the last one: step 2)
    crash_after(monkeypatch, 3)
    with pytest.raises(Crash):
        train.run(distill_cfg(tmp_path / "run", *common))
    monkeypatch.setattr(train, "STEP_HOOK", None)
    res = train.run(distill_cfg(tmp_path / "run", *common, "resume=true"))
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history]
    a, b = (load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("ref", "run"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
