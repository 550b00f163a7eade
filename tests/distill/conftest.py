"""Helpers for distill-stage tests: composed configs and small hand-built Seq-KD datasets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module


class Crash(RuntimeError):
    """What `crash_after`'s step hook raises: a run killed between two optimizer steps."""


def crash_after(monkeypatch, step: int) -> None:
    """Make the distill stage raise `Crash` right after optimizer step `step` (its STEP_HOOK);
    `monkeypatch.setattr(train, "STEP_HOOK", None)` lets the next run go through."""
    from specdistill.distill.train import stage as train

    def hook(done: int) -> None:
        if done == step:
            raise Crash

    monkeypatch.setattr(train, "STEP_HOOK", hook)


def _distill_cfg(out: Path, *overrides: str):
    """conf/distill.yaml on toy-tiny with a small, fast budget (overridable)."""
    base = [
        "pair=toy-tiny",
        f"output_dir={out}",
        "logger=none",
        "max_steps=6",
        "micro_batch_size=4",
        "max_seq_len=96",
        "eval.limit=8",
        "eval_every=3",
        "save_every=3",
        "optim.optimizer.lr=3e-3",
        "device=cpu",
    ]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="distill", overrides=[*base, *overrides])


def make_seqkd(path: Path, toy_tiny_pair, n: int = 32, topk: int = 0, comp_len: int = 24) -> Path:
    """A generate-stage-shaped dataset: train prompts + the target's greedy completions.

    Built by hand (argmax continuation) so tests do not depend on the generate stage's speed;
    with topk > 0 it also stores the target's top-k log-probs per completion token.
    """
    import datasets

    from specdistill.data.prompts import load_prompts

    target, _, tok = toy_tiny_pair
    prompts = load_prompts({"source": "toy", "toy": "toy-tiny"}, tok)[:n]
    rows: dict[str, list] = {k: [] for k in ("prompt_index", "sample_index", "prompt",
                                              "prompt_ids", "completion", "completion_ids",
                                              "finish_reason")}  # fmt: skip
    if topk:
        rows["topk_ids"], rows["topk_logprobs"] = [], []
    for p in prompts:
        ids = tok(p.text, add_special_tokens=False)["input_ids"][-48:]
        with torch.no_grad():
            out = target.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=comp_len, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            comp = out[0, len(ids) :].tolist()
            if topk:
                logits = target(out).logits[0, len(ids) - 1 : len(ids) - 1 + len(comp)]
                lp, ti = torch.log_softmax(logits.float(), -1).topk(topk, -1)
                rows["topk_ids"].append(ti.tolist())
                rows["topk_logprobs"].append(lp.tolist())
        rows["prompt_index"].append(p.index)
        rows["sample_index"].append(0)
        rows["prompt"].append(p.text)
        rows["prompt_ids"].append(ids)
        rows["completion"].append(tok.decode(comp))
        rows["completion_ids"].append(comp)
        rows["finish_reason"].append("length")
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return path


@pytest.fixture(scope="session")
def seqkd_dir(tmp_path_factory, toy_tiny_pair) -> Path:
    return make_seqkd(tmp_path_factory.mktemp("seqkd") / "ds", toy_tiny_pair)


@pytest.fixture(scope="session")
def seqkd_topk_dir(tmp_path_factory, toy_tiny_pair) -> Path:
    return make_seqkd(tmp_path_factory.mktemp("seqkd_topk") / "ds", toy_tiny_pair, topk=16)


@pytest.fixture
def distill_cfg():
    """A function (output_dir, *overrides) -> composed distill config on a small budget."""
    return _distill_cfg
