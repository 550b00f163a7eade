"""A stage's config composed from outside it: the primary config composed with the pipeline's
group choices and the user's `STAGE.KEY=VALUE` keys, then the pipeline's typed values merged
in, the user's keys still winning.

What the pipeline sets into a stage is a `StageOverrides`: Hydra group choices (`decoder=sampling`,
`loss=fkl`: they pick a yaml file, so Hydra composes them) and typed values (`decoder.sampling`
as the dict of a checked `Sampling`, `lmbda` as a float, paths as strings) merged into the
composed node with `OmegaConf.update`, never formatted into override strings and parsed back.
The user's section of the pipeline config arrives as command-line text, so it goes through
Hydra's override grammar as before (`format_override`) and the check every stage's own command
runs (`compose_checked`, data/stage_config.py): a removed or unknown key is one line naming the
stage and the key.

Shared by the pipeline's plan (distill/pipeline/plan.py), its serving-mode overrides
(pipeline/serving.py) and the export's vLLM check (export/in_vllm.py, which composes a validate
config for the exported folder). It lives beside the stages, not in the pipeline, because a
stage never imports the pipeline (the root DESIGN.md, "Layout and imports";
tests/test_import_contract.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.stage_config import compose_checked, picks_group


@dataclass(frozen=True)
class StageOverrides:
    """What the pipeline sets into one stage's config: Hydra group choices (`decoder=greedy`)
    and typed values by dotted key (`{"decoder.sampling": {"temperature": 0.7, ...}}`), applied
    in order after composition. The user's own `STAGE.KEY=VALUE` keys win over both."""

    groups: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)

    def __add__(self, other: StageOverrides) -> StageOverrides:
        """Both, `other`'s values after (so over) these."""
        return StageOverrides((*self.groups, *other.groups), {**self.values, **other.values})


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


def removed_keys(stage: str) -> dict[str, str]:
    """The settings `stage` removed, each with its one-line refusal: the same table its own
    command checks (`check_command_line` in its `main`)."""
    if stage == "generate":
        from specdistill.data.generate.settings import removed_keys as keys
    elif stage == "distill":
        from specdistill.distill.train.settings import removed_keys as keys
    elif stage == "online":
        from specdistill.distill.online.config import removed_keys as keys
    elif stage == "validate":
        from specdistill.decode.validate.settings import removed_keys as keys
    else:  # export removed no settings
        return {}
    return keys()


def _user_values(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys of the user's stage section that set values (not group choices)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    out: list[str] = []
    for key, value in (node or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.extend(_user_values(value, dotted + "."))
        elif not (isinstance(value, str) and picks_group(dotted)):
            out.append(dotted)
    return out


def whole_set(section: Any) -> Any:
    """The section's `dataset` when it is a whole prompt set (a node naming its `source`, as a
    sizing's `/dataset@generate.dataset: ultrachat` default composes it), else None. A whole set
    replaces the stage's own set rather than setting keys of it: it is how a pair's sizing picks
    a set that `generate.dataset.limit=N` can still change, since a key set on a bare name
    (`generate.dataset: ultrachat`) replaces the name and the stage's default set comes back."""
    node = section.get("dataset") if section else None
    return node if isinstance(node, DictConfig | Mapping) and "source" in node else None


def compose_stage(
    stage: str, cfg: DictConfig, overrides: StageOverrides | list[str] | None = None
) -> DictConfig:
    """The stage's primary config with the pipeline's pair and `overrides` (a StageOverrides,
    or plain Hydra override strings), then the user's keys under the stage's section
    (`distill.lmbda=0.5`), which win over both."""
    if not isinstance(overrides, StageOverrides):
        overrides = StageOverrides(tuple(overrides or ()))
    section = cfg.get(stage) or {}
    own_pick = any(g.partition("=")[0] == "dataset" for g in overrides.groups)
    whole = whole_set(section)
    if whole is not None or (own_pick and isinstance(section.get("dataset"), str)):
        # the step's own pick (a validate_<set> step) or the section's whole set stands alone
        if isinstance(section, DictConfig):
            section = OmegaConf.to_container(section, resolve=True)
        section = {k: v for k, v in section.items() if k != "dataset"}
    user = flatten_overrides(section)
    stage_cfg = compose_checked(
        stage, [*overrides.groups, *user], removed_keys(stage), section=stage
    )
    OmegaConf.set_struct(stage_cfg, False)
    if overrides.values:
        # copies: a merge updates a list or dict node in place, which would change a kept one
        keep = {
            key: copy.deepcopy(OmegaConf.select(stage_cfg, key)) for key in _user_values(section)
        }
        for key, value in overrides.values.items():
            OmegaConf.update(stage_cfg, key, value, merge=True)
        for key, value in keep.items():  # the user's keys, as Hydra composed them, win
            OmegaConf.update(stage_cfg, key, value, merge=False)
    if whole is not None and not own_pick:
        stage_cfg.dataset = OmegaConf.create(OmegaConf.to_container(whole, resolve=False))
    stage_cfg.pair = OmegaConf.merge(stage_cfg.pair, cfg.pair)
    return stage_cfg
