"""Rows of a prompt or document set read from a file or the hub, shared by the short prompt sets
(`data/prompts.py`) and the long-context ones (`data/long_documents.py`): one reader, one error
line per bad path or name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdistill.data.runtime import ConfigError, node_get
from specdistill.data.splits import source_split, split_path

FILE_SOURCES = ("jsonl", "json", "parquet", "csv")


def hub_rows(cfg: Any, split: str) -> list[dict]:
    """`datasets.load_dataset(dataset.name, dataset.config, split)` as a list of row dicts
    (`split` by the source's own name, `dataset.splits`)."""
    import datasets

    split = source_split(cfg, split)
    name = node_get(cfg, "name")
    if not name:
        raise ConfigError("dataset.source=hub needs dataset.name (a `datasets.load_dataset` name)")
    try:
        ds = datasets.load_dataset(
            name, node_get(cfg, "config"), split=split, revision=node_get(cfg, "revision")
        )
    except Exception as e:  # datasets raises many types for a missing dataset/split
        raise ConfigError(f"dataset.name={name!r} split={split!r} could not be loaded: {e}") from e
    return [dict(r) for r in ds]


def file_rows(cfg: Any, source: str, split: str) -> list[dict]:
    """A jsonl/json/parquet/csv file at `dataset.path` (or its file for `split`) as row dicts
    (an empty file: none)."""
    import datasets

    file = present_file(cfg, source, split)
    path, split = str(split_path(cfg, split)), source_split(cfg, split)
    if file.stat().st_size == 0:
        return []
    builder = "json" if source in ("jsonl", "json") else source
    try:
        ds = datasets.load_dataset(builder, data_files={split: str(file)}, split=split)
    except Exception as e:  # malformed files surface as many exception types
        raise ConfigError(f"dataset.path={path!r} could not be read as {source}: {e}") from e
    return [dict(r) for r in ds]


def present_file(cfg: Any, source: str, split: str) -> Path:
    """The file `dataset.path` names for `split` (`local:` resolved), refused in one line where
    it is missing: the reader's check, and the plan's (data/dataset_files.py) before any step
    runs."""
    from specdistill.data.local_data import resolve_path

    path = resolve_path(split_path(cfg, split))
    if not path or not Path(path).expanduser().exists():
        raise ConfigError(f"dataset.path={path!r} does not exist: point it at a {source} file")
    return Path(path).expanduser()
