"""Shards and chunks of the generate stage: who generates what, how it is stored, how it merges.

A run is split into shards (ranks of `accelerate launch`/`torchrun`, or tasks of a Slurm array)
and each shard into chunks, the unit of resume. Every chunk is a parquet file written to a temp
name and renamed, so a SIGKILL leaves either a whole chunk or none. All files of one config live
under `chunks/<fingerprint>/`, so a changed config can never mix its rows with an older one's.
Merging (`merge.py`) needs only the output folder: it reads `generation_config.json` and every
shard's `done.json`, checks that each planned prompt is there exactly once, and writes the
dataset; the rows' layout is `storage.py`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from specdistill.data.generate.storage import rows_table
from specdistill.data.io import atomic_write_json, guard_write, read_json
from specdistill.data.runtime import ConfigError

CONFIG_FILE = "generation_config.json"
RESULT_FILE = "result.json"
DONE_FILE = "done.json"
# Files `Dataset.save_to_disk` writes at the top of the output folder (replaced on each merge).
_DATASET_FILES = ("state.json", "dataset_info.json")


def resolve_shard(
    index: int | None, count: int | None, env: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """(index, count) from explicit `shard.*` values, else RANK/WORLD_SIZE, else (0, 1)."""
    env = os.environ if env is None else env
    if count is None:
        count = int(env.get("WORLD_SIZE", "1"))
    if index is None:
        index = int(env.get("RANK", "0")) if count > 1 else 0
    if count < 1:
        raise ConfigError(f"shard.count={count} must be >= 1 (or null for the world size)")
    if not 0 <= index < count:
        raise ConfigError(f"shard.index={index} must be in [0, shard.count={count})")
    return int(index), int(count)


def plan_shard(
    lengths: Mapping[int, int], index: int, count: int, chunk_size: int
) -> list[list[int]]:
    """The chunks (lists of prompt indices) shard `index` of `count` generates.

    Prompts are sorted by (length, index) and dealt out round-robin, so every shard gets a
    similar length mix; within a shard, neighbouring chunks hold prompts of similar length,
    which keeps left padding small. The plan depends only on its arguments: a restart with
    the same config finds the same chunks.
    """
    order = sorted(lengths, key=lambda i: (lengths[i], i))[index::count]
    return [order[k : k + chunk_size] for k in range(0, len(order), chunk_size)]


def fingerprint(record: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-able config record."""
    blob = json.dumps(record, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def chunk_seed(seed: int, shard_index: int, chunk: int) -> int:
    """A per-chunk sampling seed, so a resumed chunk draws what it would have drawn unbroken."""
    digest = hashlib.sha256(f"{seed}/{shard_index}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def shard_dir(output_dir: str | Path, fp: str, index: int, count: int) -> Path:
    return Path(output_dir) / "chunks" / fp / f"shard-{index:05d}-of-{count:05d}"


def chunk_path(sdir: Path, chunk: int) -> Path:
    return sdir / f"chunk-{chunk:05d}.parquet"


def claim_output_dir(output_dir: str | Path, record: dict[str, Any], overwrite: bool) -> None:
    """Record the config in `output_dir`, refusing to mix it with another config's files.

    With `overwrite`, files of other configs are removed; files of this config are kept
    (another rank of the same run may already be writing them).
    """
    out = Path(output_dir)
    path = out / CONFIG_FILE
    if path.exists():
        old = read_json(path)
        if old.get("fingerprint") != record["fingerprint"]:
            if not overwrite:
                raise ConfigError(
                    f"output_dir={str(out)!r} holds a generation run with another config "
                    f"({_config_diff(old, record)}): use a new output_dir, the same config to "
                    "resume, or overwrite=true to discard it"
                )
            _discard_other_runs(out, record["fingerprint"])
    atomic_write_json(path, record)


def _config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if k != "fingerprint" and old.get(k) != new.get(k))
    return "differs in " + ", ".join(keys) if keys else "different fingerprint"


def _discard_other_runs(out: Path, keep: str) -> None:
    chunks = out / "chunks"
    if chunks.is_dir():
        for d in chunks.iterdir():
            if d.name != keep:
                shutil.rmtree(d, ignore_errors=True)
    for name in (*_DATASET_FILES, RESULT_FILE):
        (out / name).unlink(missing_ok=True)
    for f in out.glob("data-*.arrow"):
        f.unlink(missing_ok=True)


def write_chunk(
    path: Path, rows: Sequence[Mapping[str, Any]], topk: int, chat: bool = False
) -> Path:
    """Write rows as parquet to a temp file, fsync, and rename: a chunk is all or nothing.
    `topk`: K stored entries per position (0: none), in the compact layout of `storage.py`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = rows_table(rows, topk, chat)
    with guard_write(path, table.nbytes, cleanup=(tmp,)):  # never a half chunk, nor its temp
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return path


def chunk_is_complete(path: Path, prompt_indices: Sequence[int], num_samples: int) -> bool:
    """A chunk file counts as done only if it holds exactly its planned prompts."""
    if not path.exists():
        return False
    got = Counter(pq.read_table(path, columns=["prompt_index"]).column(0).to_pylist())
    return got == Counter({i: num_samples for i in prompt_indices})


def write_done(sdir: Path, record: Mapping[str, Any]) -> Path:
    return atomic_write_json(sdir / DONE_FILE, record)


def shard_records(output_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """The run's config record and, per shard, its done record (None: not finished)."""
    out = Path(output_dir)
    if not (out / CONFIG_FILE).exists():
        raise ConfigError(
            f"output_dir={str(out)!r} has no {CONFIG_FILE}: run the generate stage there first"
        )
    config = read_json(out / CONFIG_FILE)
    fp, count = config["fingerprint"], int(config["shard_count"])
    records = []
    for i in range(count):
        done = shard_dir(out, fp, i, count) / DONE_FILE
        rec = read_json(done) if done.exists() else None
        records.append(rec if rec and rec.get("fingerprint") == fp else None)
    return config, records
