"""Every refusal a stage makes at run time for a config, data or install reason, and the plan
making it first.

One table: each row is a stage's run-time refusal (the step, the overrides that cause it, the
stage's own words). For each, the stage itself is run on the step's config with the plan's checks
switched off, and must refuse with those words before any model loads; then `build_plan` must
refuse with the same words, the step's name in front, before anything is written. What is left
to run time needs a GPU, the hub or the weights (a CUDA device, a hub id's files, a checkpoint's
tensors). Two refusals are shown elsewhere: training rows among validate's prompts
(tests/distill/test_heldout_plan.py: validate's run-time check reads generate's output, so the
plan's rule is the configs' one) and the Slurm settings (tests/distill/test_slurm_jobs.py: they are
the submission's, checked before any job is sent).
"""

from __future__ import annotations

import re
import sys

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.distill.pipeline import plan as plan_module
from specdistill.distill.pipeline.execute import _stage_runner

VLLM_MISSING = "but vLLM is not installed: install the extra"


def _rows(tmp_path, world) -> list[tuple[str, list[str], str]]:
    """(the refusing step, overrides, the stage's words as a regex)."""
    missing = tmp_path / "missing.jsonl"
    present = tmp_path / "present.jsonl"
    present.write_text('{"prompt": "def f(x):"}\n')
    return [
        ("generate", ["++generate.backend=vllm"], f"^backend=vllm {VLLM_MISSING}"),
        (
            "distill",
            ["stages=[generate,distill]", "++distill.lmbda=0.5", "++distill.onpolicy.engine=vllm"],
            f"^onpolicy.engine=vllm {VLLM_MISSING}",
        ),
        (
            "validate",
            ["stages=[validate]", "++validate.engines=[ours,vllm]"],
            re.escape("engines=[ours,vllm] ") + VLLM_MISSING,
        ),
        (
            "validate",
            ["stages=[validate]", "++validate.engines=[ours,llamacpp]"],
            re.escape("engines=[ours,llamacpp]: llama-server is not built"),
        ),
        (
            "export",
            ["stages=[export]", f"++export.drafter={world.drafter_dir}", "vllm=true"],
            f"^vllm.enabled=true {VLLM_MISSING}",
        ),
        ("generate", ["pair.target=/nope/target"], r"^pair.target='/nope/target' does not exist"),
        (
            "generate",  # a named drafter wins over one cut from the target's layers
            ["++pair.drafter_layers=first:1", "pair.drafter=/nope/drafter"],
            r"^pair.drafter='/nope/drafter' does not exist",
        ),
        (
            "generate",
            ["dataset=jsonl", f"dataset.path={{train: {missing}, test: {present}}}"],
            f"^dataset.path='{missing}' does not exist: point it at a jsonl file",
        ),
        (
            "validate",
            [
                "stages=[validate]",
                "dataset=jsonl",
                f"dataset.path={{train: {present}, test: {missing}}}",
            ],
            f"^dataset.path='{missing}' does not exist",
        ),
        (
            "generate",
            ["pair.attn_implementation=flash2"],
            r"^pair.attn_implementation='flash2' is not an attention kernel",
        ),
        (
            "distill",
            ["++distill.fsdp=true", "++distill.deepspeed=zero2"],
            r"^fsdp=true: DeepSpeed shards the model itself",
        ),
        (
            "distill",
            ["serving=sampling", "++distill.fsdp=true", "++distill.onpolicy.engine=vllm"],
            r"^onpolicy.engine=vllm: FSDP2 shards the drafter's weights",
        ),
        (
            "distill",
            ["++distill.lmbda=0.5", "++distill.deepspeed=zero3", "++distill.onpolicy.engine=vllm"],
            r"^onpolicy.engine=vllm: ZeRO-3",
        ),
        (
            "distill",
            ["++distill.fsdp=true", "++distill.mixed_precision=fp16"],
            r"^fsdp=true with mixed_precision=fp16",
        ),
        (
            "online",
            ["stages=[online]", "++online.engine=llamacpp"],
            re.escape("engine=llamacpp: llama-server is not built"),
        ),
        (
            "online",
            ["stages=[online]", "++online.engine=vllm"],
            f"^engine=vllm {VLLM_MISSING}",
        ),
        (
            "online",
            [
                "stages=[generate,distill,online]",
                "++online.engine=llamacpp",
                "++online.record=rejected",
            ],
            r"^record=rejected with engine=llamacpp: the server reports",
        ),
        ("generate", ["++generate.topk_logprobs=-1"], r"^topk_logprobs=-1"),
        ("export", ["++export.min_positions=0"], r"^min_positions=0"),
    ]


ROW_IDS = ["generate-vllm", "distill-rollouts-vllm", "validate-vllm", "validate-llamacpp",
           "export-vllm", "pair-path", "named-drafter-path", "generate-file", "validate-file", "attention-kernel",
           "fsdp-deepspeed", "fsdp-vllm-rollouts", "zero3-vllm-rollouts", "fsdp-fp16",
           "online-llamacpp", "online-vllm", "online-engine-setting", "generate-setting", "export-setting"]  # fmt: skip


def _cfg(run_dir, overrides: list[str]):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose("pipeline", overrides=[f"run_dir={run_dir}", "pair=toy-tiny", *overrides])


@pytest.fixture
def nothing_installed(monkeypatch, tmp_path):
    """No vLLM, no llama-server, and no model may load: a refusal must come first."""
    from transformers import AutoModelForCausalLM

    from specdistill.decode.llamacpp import build

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "no-llama-build")
    monkeypatch.delenv("SPECDISTILL_LLAMA_SERVER", raising=False)

    def no_weights(*args, **kwargs):
        raise AssertionError("a model loaded before the stage refused its config")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)


@pytest.mark.parametrize("row", range(len(ROW_IDS)), ids=ROW_IDS)
def test_the_stage_refuses_at_run_time_and_the_plan_first(
    row, tmp_path, monkeypatch, toy_tiny, nothing_installed
):
    name, overrides, words = _rows(tmp_path, toy_tiny)[row]
    # the stage on its own step's config, the plan's checks off: its run-time refusal
    with monkeypatch.context() as m:
        for check in ("check_steps", "check_preflight", "check_heldout_plan"):
            m.setattr(plan_module, check, lambda steps: None)
        steps = {s.name: s for s in plan_module.build_plan(_cfg(tmp_path / "unchecked", overrides))}
    step = steps[name]
    with pytest.raises(ConfigError) as at_run:
        _stage_runner(step.stage)(OmegaConf.create(step.config))
    assert re.search(words, str(at_run.value)), str(at_run.value)
    # the plan: the same words, the step named, one line, nothing written
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as at_plan:
        plan_module.build_plan(_cfg(run_dir, overrides))
    text = str(at_plan.value)
    assert text.startswith(f"{name}: ") and re.search(words, text.removeprefix(f"{name}: "))
    assert "\n" not in text and not run_dir.exists()
