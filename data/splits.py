"""Which rows of a source a stage reads: the one rule from a stage's role to the source's split,
its file and its side of a held-out split. The readers apply it at run time
(data/dataset_rows.py, data/chat_prompts.py) and the pipeline's plan reads it from the configs
alone (data/heldout_check.py), so what the plan refuses is what the run would read.

A stage asks for a role: `train` (generate, distill's own rows) or `test` (distill's eval,
validate). A dataset node turns it into rows:

    dataset.split: NAME                      every role reads NAME (a set that is one split)
    dataset.splits: {train: A, test: B}      the source's own names for the roles (UltraChat's
                                             train_sft / test_sft); a name not listed is itself
    dataset.path: {train: F1, test: F2}      a local file per split, as `datasets`' data_files
    dataset.holdout: {count | share, seed, from_split}
                                             conversations kept back from one split (from_split,
                                             default the train role's): train reads the rest,
                                             any other role the held-out ones
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specdistill.data.runtime import ConfigError, node_get

TRAIN = "train"  # the role of the rows a drafter trains on
EVAL = "test"  # the role of held-out rows: distill's eval and validate read it by default


def _mapping(cfg: Any, key: str) -> Mapping[str, Any] | None:
    """`dataset.KEY` when it is a mapping (a DictConfig or a dict), else None."""
    value = node_get(cfg, key)
    return value if value is not None and hasattr(value, "items") else None


def source_split(cfg: Any, split: str) -> str:
    """The source's name for `split`: its entry in `dataset.splits`, else `split` itself."""
    raw = node_get(cfg, "splits")
    if raw is None:
        return split
    names = _mapping(cfg, "splits")
    if names is None:
        raise ConfigError(
            f"dataset.splits={raw!r} must map roles to the source's split names, e.g. "
            "{train: train_sft, test: test_sft}"
        )
    return str(names.get(split) or split)


def split_path(cfg: Any, split: str) -> Any:
    """`dataset.path` for `split`: the path itself, or its entry when it maps splits to files
    (a split it does not list is one error line naming the ones it does)."""
    files = _mapping(cfg, "path")
    if files is None:
        return node_get(cfg, "path")
    name = source_split(cfg, split)
    if name not in files:
        raise ConfigError(
            f"dataset.path has no file for split {name!r} (it lists {sorted(files)}): add "
            f"dataset.path.{name}=FILE, or set dataset.split to one of them"
        )
    return files[name]


def stage_role(cfg: Any, default: str) -> str:
    """The role a stage reads the node for: `dataset.split` when set, else the stage's own."""
    return str(node_get(cfg, "split") or default)


def read_split(cfg: Any, role: str) -> str:
    """The split holding the rows of `role`, before `source_split` names it: with a holdout, the
    split it is cut from (`holdout.from_split`, else the train role's); otherwise the role."""
    holdout = node_get(cfg, "holdout")
    if holdout:
        return str(node_get(holdout, "from_split") or TRAIN)
    return role


def holdout_side(role: str) -> str:
    """Which conversations of a held-out split a role reads: `train` the rest, any other role
    the held-out ones (data/conversations.py's split_holdout)."""
    return "train" if role == TRAIN else "held"
