"""Every planned step's config-only checks, run when the plan is built: a combination a stage
would refuse (`fsdp=true` with `onpolicy.engine=vllm`, `fsdp=true` with a DeepSpeed config, a
bad setting of any stage) is one `error:` line from `specdistill ... plan=true`, and before the
first step of a run or a Slurm submission, not in a job hours later.

Each stage's check is the stage's own function (one home for each rule): the settings
dataclass it types its config with (`GenerateSettings`, `TrainSettings` via
`distill/train/setup.check_settings`, `ValidateSettings`, `OnlineSettings`, `ExportSettings`),
none of which loads a model or reads a prompt. What needs the machine, the files or the
weights (CUDA, an installed vLLM, a drafter's tokenizer) stays in the stage, at run time. The
stages are imported here, on demand, as the executor does (pipeline/execute.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.models.attention import check_attn_implementation
from specdistill.data.runtime import ConfigError


def _generate(cfg: DictConfig) -> None:
    from specdistill.data.generate.settings import GenerateSettings
    from specdistill.data.prompts import check_prompt_settings

    GenerateSettings.from_cfg(cfg)
    check_prompt_settings(cfg.dataset)


def _distill(cfg: DictConfig) -> None:
    from specdistill.distill.train.setup import check_settings

    check_settings(cfg)


def _online(cfg: DictConfig) -> None:
    from specdistill.distill.online.config import check_config
    from specdistill.distill.online.engine_settings import EngineSettings, check_served

    check_served(cfg, check_config(cfg), EngineSettings.from_cfg(cfg))


def _validate(cfg: DictConfig) -> None:
    from specdistill.decode.validate.settings import ValidateSettings

    ValidateSettings.from_cfg(cfg)


def _export(cfg: DictConfig) -> None:
    from specdistill.distill.export.settings import ExportSettings

    ExportSettings.from_cfg(cfg)


CHECKS: dict[str, Callable[[DictConfig], None]] = {
    "generate": _generate,
    "distill": _distill,
    "online": _online,
    "validate": _validate,
    "export": _export,
}


def check_steps(steps: list[Any]) -> None:
    """Each step's stage checks on the step's final config; the first refusal is one line
    naming the step (`distill: fsdp=true: ...`)."""
    for step in steps:
        check = CHECKS.get(step.stage)
        if check is None:  # the report step: summary.md over the others' results
            continue
        try:
            config = OmegaConf.create(step.config)
            if "pair" in config:  # the kernel every stage loads the pair with
                check_attn_implementation(config.pair.get("attn_implementation"))
            check(config)
        except ConfigError as e:
            raise ConfigError(f"{step.name}: {e}") from e
