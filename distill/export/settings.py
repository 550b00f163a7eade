"""The export stage's config typed once: `ExportSettings.from_cfg(cfg)` at the top of `run`.

conf/export.yaml is the one home of every key's default, with why (the fields here and in
gguf_files.py have none: tests/test_single_default.py); the types and every check of the stage's
own settings live here (a config built by hand without a key is one error naming it), so the
stage reads typed fields instead of parsing nodes again. What needs the machine or the files
(the check's device and its `auto` dtype, the destination, the report, the drafter folder,
whether vLLM imports) is checked by the stage, still before any weights load. The `pair` and
`vllm` nodes stay nodes: `resolve_pair` types the first, and in_vllm.py builds the validate
stage's config from the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdistill.data.runtime import ConfigError, parse_dtype, required
from specdistill.distill.export.gguf_files import GGUFSettings
from specdistill.distill.export.hub import check_repo_id


@dataclass(frozen=True)
class CheckSettings:
    """`check.*`: the self-check that runs on the written folder before it is published."""

    prompts: tuple[str, ...]
    max_new_tokens: int
    device: str
    dtype: str  # the target's dtype for the greedy comparison (fp32: no near-ties)

    @classmethod
    def from_node(cls, node: Any) -> CheckSettings:
        """The `check` node checked and typed; a ConfigError names the field."""
        prompts = tuple(node.prompts or [])
        if not prompts:
            raise ConfigError("check.prompts is empty: the self-check needs at least one prompt")
        return cls(
            prompts=prompts,
            max_new_tokens=int(required(node, "max_new_tokens", "check")),
            device=str(required(node, "device", "check")),
            dtype=str(required(node, "dtype", "check")),
        )


@dataclass(frozen=True)
class ExportSettings:
    """conf/export.yaml's own settings, checked (`pair` and `vllm` stay nodes)."""

    output_dir: Path
    check: CheckSettings
    drafter: str | None  # None: the pair's drafter
    report: str | None  # a validate report.json (or its folder)
    dtype: str  # auto: keep the drafter's dtype
    max_shard_size: str
    overwrite: bool
    min_positions: int | str  # auto: the validated context (or none)
    # llama.cpp: the drafter as GGUF files (gguf_files.py)
    gguf: GGUFSettings
    push_to_hub: str | None  # ORG/NAME: the published folder uploaded there (hub.py)
    hub_private: bool  # a repo push_to_hub creates is private

    @classmethod
    def from_cfg(cls, cfg: Any) -> ExportSettings:
        """The stage's config (DictConfig) checked and typed; a ConfigError names the field."""
        dtype = str(required(cfg, "dtype"))
        if dtype != "auto":
            parse_dtype(dtype, "cpu")  # a name it does not know is one `dtype=` error
        min_pos = required(cfg, "min_positions")
        if min_pos != "auto" and (not isinstance(min_pos, int) or min_pos < 1):
            raise ConfigError(f"min_positions={min_pos!r} must be auto or a positive integer")
        check = CheckSettings.from_node(cfg.check)
        private = required(cfg, "hub_private")
        if not isinstance(private, bool):
            raise ConfigError(f"hub_private={private!r} must be true or false")
        drafter, report = required(cfg, "drafter"), required(cfg, "report")
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            check=check,
            drafter=str(drafter) if drafter else None,
            report=str(report) if report else None,
            dtype=dtype,
            max_shard_size=str(required(cfg, "max_shard_size")),
            overwrite=bool(required(cfg, "overwrite")),
            min_positions=min_pos,
            gguf=GGUFSettings.from_node(required(cfg, "gguf")),
            push_to_hub=check_repo_id(required(cfg, "push_to_hub")),
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
