"""The export stage's config typed once: `ExportSettings.from_cfg(cfg)` at the top of `run`.

conf/export.yaml lists the values users see; the defaults of a key a caller's config lacks and
every check of the stage's own settings live here, so the stage reads typed fields instead of
parsing nodes again. What needs the machine or the files (the check's device and its `auto`
dtype, the destination, the report, the drafter folder, whether vLLM imports) is checked by the
stage, still before any weights load. The `pair` and `vllm` nodes stay nodes: `resolve_pair`
types the first, and in_vllm.py builds the validate stage's config from the second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdistill.data.runtime import ConfigError, parse_dtype, setting
from specdistill.distill.export.gguf_files import GGUFSettings
from specdistill.distill.export.hub import check_repo_id


@dataclass(frozen=True)
class CheckSettings:
    """`check.*`: the self-check that runs on the written folder before it is published."""

    prompts: tuple[str, ...]
    max_new_tokens: int = 24
    device: str = "auto"
    dtype: str = "fp32"  # the target's dtype for the greedy comparison (fp32: no near-ties)

    @classmethod
    def from_node(cls, node: Any) -> CheckSettings:
        """The `check` node checked and typed; a ConfigError names the field."""
        prompts = tuple(node.prompts or [])
        if not prompts:
            raise ConfigError("check.prompts is empty: the self-check needs at least one prompt")
        return cls(
            prompts=prompts,
            max_new_tokens=int(setting(node, cls, "max_new_tokens")),
            device=str(setting(node, cls, "device")),
            dtype=str(setting(node, cls, "dtype")),
        )


@dataclass(frozen=True)
class ExportSettings:
    """conf/export.yaml's own settings, checked (`pair` and `vllm` stay nodes)."""

    output_dir: Path
    check: CheckSettings
    drafter: str | None = None  # None: the pair's drafter
    report: str | None = None  # a validate report.json (or its folder)
    dtype: str = "auto"  # auto: keep the drafter's dtype
    max_shard_size: str = "5GB"
    overwrite: bool = False
    min_positions: int | str = "auto"  # auto: the validated context (or none)
    # llama.cpp: the drafter as GGUF files (gguf_files.py)
    gguf: GGUFSettings = field(default_factory=GGUFSettings)
    push_to_hub: str | None = None  # ORG/NAME: the published folder uploaded there (hub.py)
    hub_private: bool = True  # a repo push_to_hub creates is private

    @classmethod
    def from_cfg(cls, cfg: Any) -> ExportSettings:
        """The stage's config (DictConfig) checked and typed; a ConfigError names the field."""
        dtype = str(setting(cfg, cls, "dtype"))
        if dtype != "auto":
            parse_dtype(dtype, "cpu")  # a name it does not know is one `dtype=` error
        min_pos = setting(cfg, cls, "min_positions")
        if min_pos != "auto" and (not isinstance(min_pos, int) or min_pos < 1):
            raise ConfigError(f"min_positions={min_pos!r} must be auto or a positive integer")
        check = CheckSettings.from_node(cfg.check)
        private = setting(cfg, cls, "hub_private")
        if not isinstance(private, bool):
            raise ConfigError(f"hub_private={private!r} must be true or false")
        drafter, report = cfg.get("drafter"), cfg.get("report")
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            check=check,
            drafter=str(drafter) if drafter else None,
            report=str(report) if report else None,
            dtype=dtype,
            max_shard_size=str(setting(cfg, cls, "max_shard_size")),
            overwrite=bool(setting(cfg, cls, "overwrite")),
            min_positions=min_pos,
            gguf=GGUFSettings.from_node(cfg.get("gguf")),
            push_to_hub=check_repo_id(setting(cfg, cls, "push_to_hub")),
            hub_private=private,
        )

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The dtype the weights are written in; None keeps the drafter's own."""
        return None if self.dtype == "auto" else parse_dtype(self.dtype, "cpu")

    @property
    def drafter_field(self) -> str:
        """The config key that named the exported drafter, for its error lines."""
        return "drafter" if self.drafter else "pair.drafter"
