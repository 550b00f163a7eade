"""The toy world builds, is an ordinary HF checkpoint set, and has the prompts stages rely on."""

from __future__ import annotations

import json

import torch

from specdistill.data.toy.world import extract_prompts, read_jsonl


def test_toy_tiny_is_real_hf_checkpoints(toy_tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_tiny.target_dir)
    target = AutoModelForCausalLM.from_pretrained(toy_tiny.target_dir)
    drafter = AutoModelForCausalLM.from_pretrained(toy_tiny.drafter_dir)
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert target.config.vocab_size == drafter.config.vocab_size == len(tok)
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in drafter.parameters())
    assert n_d * 3 < n_t, "the drafter must be much smaller than the target"
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round-trips code


def test_toy_target_learned_more_than_drafter(toy_tiny):
    info = toy_tiny.build_info
    uniform = torch.log(torch.tensor(float(info["spec"]["vocab_size"]))).item()
    assert info["target"]["heldout_loss"] < info["drafter"]["heldout_loss"] < uniform


def test_prompts_heldout_and_enough(toy_tiny):
    test = read_jsonl(toy_tiny.test_prompts)
    train = read_jsonl(toy_tiny.train_prompts)
    assert len(test) >= 200
    assert {r["module"] for r in test}.isdisjoint({r["module"] for r in train})
    for r in test[:50]:
        assert r["prompt"].startswith(("def ", "async def "))
        assert r["prompt"].rstrip().endswith(('"', "'")), r["prompt"][-20:]
        assert r["completion"].strip()


def test_extract_prompts_cuts_after_docstring():
    src = 'class A:\n    def f(self, x):\n        """Doc."""\n        return x\n'
    rows = extract_prompts(src, "m.py")
    assert rows == [
        {
            "prompt": 'def f(self, x):\n    """Doc."""',
            "completion": "\n    return x\n",
            "module": "m.py",
            "name": "f",
        }
    ]


def test_build_is_cached(toy_tiny):
    from specdistill.data.toy.world import ensure_toy_world

    before = json.loads((toy_tiny.root / "build.json").read_text())
    again = ensure_toy_world("toy-tiny")
    assert again.root == toy_tiny.root
    assert again.build_info == before


def test_prompts_without_a_built_world_are_the_worlds_prompts(toy_tiny, tmp_path, monkeypatch):
    """A real pair reads toy prompts without training the toy models: the prompts-only path
    gives exactly the built world's rows (same modules, cap and order), and builds nothing."""
    import pytest

    from specdistill.data.runtime import ConfigError
    from specdistill.data.toy.world import toy_prompts

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path))
    for split, path in (("train", toy_tiny.train_prompts), ("test", toy_tiny.test_prompts)):
        assert toy_prompts("toy-tiny", split) == read_jsonl(path)
    assert not list((tmp_path / "toy").glob("*/build.json"))  # no world was built
    assert toy_prompts("toy-tiny", "test") == read_jsonl(toy_tiny.test_prompts)  # cached copy
    with pytest.raises(ConfigError, match="dataset.toy="):
        toy_prompts("toy-huge", "train")
