"""Shards and chunks of the generate stage: who generates what, how it is stored, how it merges.

A run is split into shards (ranks of `accelerate launch`/`torchrun`, or tasks of a Slurm array)
and each shard into chunks, the unit of resume. Every chunk is a parquet file written to a temp
name and renamed, so a SIGKILL leaves either a whole chunk or none. All files of one config live
under `chunks/<fingerprint>/`, so a changed config can never mix its rows with an older one's.
Merging needs only the output folder: it reads `generation_config.json` and every shard's
`done.json`, checks that each planned prompt is there exactly once, and writes the dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import FileLock

from specdistill.data.generate.batched import sampled_prompt
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


def chunk_schema(topk: bool, chat: bool = False) -> pa.Schema:
    """The row schema the distill stage reads (see the generate stage's docstring); chat sets'
    rows also name their conversation, turn and head tokens (`data/generate/turns.py`)."""
    fields = [
        ("prompt_index", pa.int64()),
        ("sample_index", pa.int64()),
        ("prompt", pa.string()),
        ("prompt_ids", pa.list_(pa.int64())),
        ("completion", pa.string()),
        ("completion_ids", pa.list_(pa.int64())),
        ("finish_reason", pa.string()),
    ]
    if topk:
        fields += [
            ("topk_ids", pa.list_(pa.list_(pa.int64()))),
            ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ]
    if chat:
        fields += [("conversation_index", pa.int64()), ("turn", pa.int64())]
        fields += [("prompt_head", pa.int64())]
    return pa.schema(fields)


def write_chunk(
    path: Path, rows: Sequence[Mapping[str, Any]], topk: bool, chat: bool = False
) -> Path:
    """Write rows as parquet to a temp file, fsync, and rename: a chunk is all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = pa.Table.from_pylist(list(rows), schema=chunk_schema(topk, chat))
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


def merge_shards(output_dir: str | Path, wall_seconds: float | None = None) -> dict[str, Any]:
    """Merge every finished shard into the `datasets` dataset at `output_dir`; return result.json.

    Safe to call from several processes at once (a file lock serialises them, and a merge that
    is already on disk for this fingerprint is not redone). Raises ConfigError naming the
    unfinished shards.
    """
    out = Path(output_dir)
    with FileLock(str(out / ".merge.lock")):
        config, records = shard_records(out)
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            raise ConfigError(
                f"cannot merge {str(out)!r}: shards {missing} of {len(records)} are not finished; "
                "run them (shard.index=I shard.count=N) with the same config, then merge again"
            )
        done_recs = [r for r in records if r is not None]
        result_path = out / RESULT_FILE
        if result_path.exists() and (out / "state.json").exists():
            previous = read_json(result_path)
            if previous.get("fingerprint") == config["fingerprint"]:
                return previous
        table = _read_rows(out, config, done_recs)
        _save_dataset(out, table, config)
        result = _result(config, done_recs, table, wall_seconds)
        atomic_write_json(result_path, result)
        return result


def _read_rows(out: Path, config: Mapping[str, Any], records: Sequence[Mapping]) -> pa.Table:
    fp, count = config["fingerprint"], int(config["shard_count"])
    schema = chunk_schema(int(config["topk_logprobs"]) > 0, "chat_turns" in config)
    files = sorted(
        f
        for rec in records
        for f in shard_dir(out, fp, rec["shard_index"], count).glob("chunk-*.parquet")
    )
    tables = [pq.read_table(f, schema=schema) for f in files]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    table = table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
    n = int(config["sampling"]["num_samples"])
    expected = Counter({i: n for rec in records for i in rec["prompt_indices"]})
    got = Counter(table.column("prompt_index").to_pylist())
    if got != expected:
        bad = sorted(set(got) ^ set(expected) | {i for i in got if got[i] != expected.get(i)})
        raise RuntimeError(
            f"merge of {str(out)!r}: rows do not match the plan for prompts {bad[:10]} "
            f"({len(bad)} prompts); delete {out / 'chunks'} and rerun"
        )
    return table


def _save_dataset(out: Path, table: pa.Table, config: Mapping[str, Any]) -> None:
    """save_to_disk into a temp folder, then move its files over `output_dir`, state.json last."""
    import datasets
    from datasets.table import InMemoryTable

    info = datasets.DatasetInfo(description=json.dumps(config, sort_keys=True))
    tmp = out / f".merge-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with guard_write(out, table.nbytes, cleanup=(tmp,)):  # no state.json: not read as merged
        datasets.Dataset(InMemoryTable(table), info=info).save_to_disk(str(tmp))
    new = {f.name for f in tmp.iterdir()}
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "state.json"):
        os.replace(f, out / f.name)
    for f in out.glob("data-*.arrow"):
        if f.name not in new:
            f.unlink()
    tmp.rmdir()


def _result(
    config: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    table: pa.Table,
    wall_seconds: float | None,
) -> dict[str, Any]:
    lengths = pc.list_value_length(table.column("completion_ids")).to_pylist()
    reasons = Counter(table.column("finish_reason").to_pylist())
    new_tokens = sum(int(r["new_tokens"]) for r in records)
    gen_seconds = sum(float(r["generation_seconds"]) for r in records)
    # shards run side by side (ranks, processes, array tasks): the slowest one's time is the
    # span the tokens took; the sum is shard-seconds (reported as generation_seconds)
    span = max((float(r["generation_seconds"]) for r in records), default=0.0)
    walls = [float(r["wall_seconds"]) for r in records]
    stats = config["prompt_stats"]
    share = config["sampling"].get("sampled_share")  # a mixed set: how many rows were sampled
    mixed = {}
    if share is not None:
        indices = table.column("prompt_index").to_pylist()
        mixed = {"sampled_samples": sum(sampled_prompt(int(i), float(share)) for i in indices)}
    return {
        "output_dir": config["output_dir"],
        "fingerprint": config["fingerprint"],
        "backend": config.get("backend", "hf"),  # the one field that tells the engines apart
        "prompts_in_source": stats["total"],
        "prompts": len(set(table.column("prompt_index").to_pylist())),
        "samples_per_prompt": int(config["sampling"]["num_samples"]),
        "samples": table.num_rows,
        **mixed,
        "skipped_long_prompts": stats["skipped_long"],
        "skipped_empty_prompts": stats["skipped_empty"],
        "truncated_long_prompts": stats["truncated_long"],
        "tokens_generated": int(sum(lengths)),
        "finish_reasons": {"eos": reasons.get("eos", 0), "length": reasons.get("length", 0)},
        # What the last run of each shard generated (a resumed run: only the missing chunks).
        "new_tokens": new_tokens,
        "generation_seconds": round(gen_seconds, 3),
        "tokens_per_s": round(new_tokens / span, 1) if span else 0.0,
        "wall_seconds": round(max([*walls, wall_seconds or 0.0]), 3),
        "shard_count": len(records),
        "shards": [
            {k: v for k, v in r.items() if k not in ("prompt_indices", "fingerprint")}
            for r in records
        ],
        "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
