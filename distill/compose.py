"""A stage's config composed from outside it: Hydra overrides formatted, the primary config
composed with a pair and overrides, the user's `STAGE.KEY=VALUE` keys on top.

Shared by the pipeline's plan (distill/pipeline/plan.py), its serving-mode overrides
(pipeline/serving.py) and the export's vLLM check (export/in_vllm.py, which composes a validate
config for the exported folder). It lives beside the stages, not in the pipeline, because a stage
never imports the pipeline (DESIGN.md, "Layout and imports"; tests/test_import_contract.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import hydra
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError


def format_override(key: str, value: Any) -> str:
    """One Hydra command-line override, quoting strings the override grammar would misread."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, int | float):
        return f"{key}={value}"
    if isinstance(value, list | tuple):
        return f"{key}=[{','.join(format_override('x', v)[2:] for v in value)}]"
    if isinstance(value, dict):  # e.g. the items of online's `stream` list
        items = (f"{k}:{format_override('x', v)[2:]}" for k, v in value.items())
        return f"{key}={{{','.join(items)}}}"
    text = str(value)
    if text and all(c.isalnum() or c in "_-./" for c in text):
        return f"{key}={text}"
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"{key}='{escaped}'"


def flatten_overrides(node: Any, prefix: str = "") -> list[str]:
    """Nested stage overrides as dotted `key=value` strings (a bare string may pick a group)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    out: list[str] = []
    for key, value in (node or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(flatten_overrides(value, dotted + "."))
        else:
            out.append(format_override(dotted, value))
    return out


def _one_line(stage: str, e: Exception) -> str:
    """Hydra's composition error as one line naming the stage (and the key, when it is one)."""
    text = " ".join(str(e).split())
    unknown = re.match(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        return (
            f"{stage}: no key `{key}` in the {stage} stage (from `{stage}.{key}`; "
            f"its keys are in conf/{stage}.yaml)"
        )
    return f"{stage}: {text} (check the `{stage}:` section of the pipeline config)"


@contextlib.contextmanager
def config_module() -> Iterator[None]:
    """Hydra's config search path, initialised once for a run of compositions."""
    if GlobalHydra.instance().is_initialized():
        yield
    else:
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            yield


def compose_stage(stage: str, cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The stage's primary config with the pipeline's pair and the given overrides, then the
    user's keys under the stage's section (`distill.lmbda=0.5`), which win."""
    user = flatten_overrides(cfg.get(stage) or {})
    try:
        with config_module():
            stage_cfg = hydra.compose(config_name=stage, overrides=[*overrides, *user])
    except Exception as e:  # hydra's errors name the bad key; add which section it came from
        raise ConfigError(_one_line(stage, e)) from e
    OmegaConf.set_struct(stage_cfg, False)
    stage_cfg.pair = OmegaConf.merge(stage_cfg.pair, cfg.pair)
    return stage_cfg
