"""What a step would refuse for a missing file or engine, refused when the plan is built.

step_checks.py runs each stage's config-only checks; these are the rest of what a stage refuses
before loading weights that depends on this machine's files and installs rather than on the
config: a model folder or a data file that is not there, vLLM not installed (or outside the
releases tested), llama-server not built. The plan runs where the steps run (the same
filesystem and venv; a Slurm login node shares both), so a run that would stop at its third step
stops before its first. What needs the GPU, the hub or the weights stays with the stage.

Each refusal is the stage's own function with the stage's own wording, so the plan's line is the
run's line with the step's name in front. Paths a planned step writes (a later step's drafter is
distill's output) are not checked: they exist once their step has run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from specdistill.data.dataset_files import check_files
from specdistill.data.models.pairs import check_model_path, named_folders
from specdistill.data.runtime import required
from specdistill.data.splits import EVAL, TRAIN
from specdistill.distill.pipeline.heldout_plan import EVAL_SOURCES

Check = Callable[[], object]


def check_preflight(steps: list[Any]) -> None:
    """Each step's file and install checks, in plan order; the first refusal is one line
    naming the step (`validate_base: engines=[ours,vllm] but vLLM is not installed: ...`)."""
    from specdistill.data.runtime import ConfigError

    produced = [Path(str(step.out_dir)).resolve() for step in steps]
    for step in steps:
        for check in _checks(step, produced):
            try:
                check()
            except ConfigError as e:
                raise ConfigError(f"{step.name}: {e}") from e


def _checks(step: Any, produced: list[Path]) -> Iterator[Check]:
    cfg = step.config
    if cfg.get("pair"):
        yield from _pair_paths(cfg["pair"], produced)
    dataset = cfg.get("dataset")
    if step.stage == "generate":
        if dataset:
            yield lambda: check_files(dataset, str(cfg.get("split") or TRAIN))
        if str(required(cfg, "backend")) == "vllm":
            yield _vllm(step.stage)
    elif step.stage == "distill":
        if dataset and (cfg.get("eval") or {}).get("source") in EVAL_SOURCES:
            yield lambda: check_files(dataset, EVAL)
        if _vllm_rollouts(cfg):
            yield _vllm(step.stage)
    elif step.stage == "validate":
        if dataset:
            yield lambda: check_files(dataset, EVAL)
        engines = [str(e) for e in cfg.get("engines") or ()]
        if "vllm" in engines:
            yield _vllm(step.stage)
        if "llamacpp" in engines:
            yield _llama_server
    elif step.stage == "online" and required(cfg, "engine") == "llamacpp":
        yield lambda: _llama_server("engine=llamacpp")
    elif (step.stage == "online" and required(cfg, "engine") == "vllm") or (
        step.stage == "export" and required(required(cfg, "vllm"), "enabled", "vllm")
    ):
        yield _vllm(step.stage)


def _pair_paths(pair: dict[str, Any], produced: list[Path]) -> Iterator[Check]:
    """The pair's named local folders, as `resolve_pair` checks them (`named_folders`), except
    where an earlier step writes them."""
    for field, name in named_folders(pair.get):
        path = Path(name).expanduser().resolve()
        if any(path.is_relative_to(out) for out in produced):
            continue
        yield lambda field=field, name=name: check_model_path(field, name)


def _vllm_rollouts(cfg: dict[str, Any]) -> bool:
    """Whether distill asks for vLLM by name and has on-policy batches to roll out (`auto`
    falls back to transformers where vLLM is missing, so only `vllm` is refused)."""
    from omegaconf import OmegaConf

    from specdistill.distill.train.settings import TrainSettings

    s = TrainSettings.from_cfg(OmegaConf.create(cfg))
    return s.onpolicy.engine == "vllm" and s.most_onpolicy > 0


def _vllm(stage: str) -> Check:
    """vLLM installed and tested, named as the stage's own refusal names what asked for it."""
    from specdistill.data.generate.vllm_engine import check_vllm_installed

    return lambda: check_vllm_installed(_vllm_asked_by(stage))


def _vllm_asked_by(stage: str) -> str:
    if stage == "generate":
        return "backend=vllm"  # require_vllm's default: generate's own key
    if stage == "distill":
        from specdistill.distill.train.rollouts import ASKED_BY
    elif stage == "validate":
        from specdistill.decode.validate.vllm_engine import ASKED_BY
    elif stage == "online":
        from specdistill.distill.online.engines.vllm import ASKED_BY
    else:
        from specdistill.distill.export.in_vllm import ASKED_BY
    return ASKED_BY


def _llama_server(asked_by: str | None = None) -> None:
    from specdistill.decode.llamacpp.build import llama_server_binary
    from specdistill.decode.llamacpp.files import ASKED_BY

    llama_server_binary(asked_by or ASKED_BY)
