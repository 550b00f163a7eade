"""The generate stage's merge: every shard's chunks into one `datasets` dataset, in bounded memory.

Rows are ordered by (prompt_index, sample_index) whatever the shard count, so a run's dataset
(and what distill trains on) does not depend on how it was sharded. Chunks hold prompts of
similar length from all over the index range, so a merge that concatenated and sorted them
held the whole table in one process (RAM >= the data). Here it is an external bucket sort:
pass 1 reads one chunk at a time and appends its rows to the bucket of their prompt-index range
(an Arrow stream file each; buckets sized to `budget_bytes`), pass 2 sorts one bucket at a time
and streams it to the dataset's Arrow files (a new file past `shard_bytes`, as `save_to_disk`
does). Peak memory: about one chunk plus a few copies of one bucket (read, sorted, cast),
flat in the row count once a set spans several buckets. The dataset files
land in the output folder by rename, `state.json` last, so a killed merge leaves the previous
dataset (or none) and reruns from the chunks.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import FileLock

from specdistill.data.generate.batched import sampled_prompt
from specdistill.data.generate.shards import RESULT_FILE, shard_dir, shard_records
from specdistill.data.generate.storage import as_storage, chunk_schema, topk_bytes
from specdistill.data.io import atomic_write_json, guard_write, read_json
from specdistill.data.runtime import ConfigError

BUDGET_BYTES = 256 << 20  # one bucket's rows in memory (Arrow bytes)
SHARD_BYTES = 500 << 20  # one dataset file, as `save_to_disk`'s default max_shard_size
MAX_BUCKETS = 512  # open bucket files at once (well under the usual 1024-descriptor limit)


def merge_shards(
    output_dir: str | Path,
    wall_seconds: float | None = None,
    *,
    budget_bytes: int = BUDGET_BYTES,
    shard_bytes: int = SHARD_BYTES,
) -> dict[str, Any]:
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
        tmp = out / f".merge-tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with guard_write(out, None, cleanup=(tmp,)):  # no state.json: not read as merged
            stats = _merge_to(tmp, out, config, done_recs, budget_bytes, shard_bytes)
        _move_dataset(tmp, out)
        result = _result(config, done_recs, stats, wall_seconds)
        atomic_write_json(result_path, result)
        return result


@dataclass
class MergeStats:
    """What the merge saw, gathered bucket by bucket (no column is ever held whole)."""

    rows: int = 0
    prompts: int = 0
    tokens: int = 0
    sampled: int = 0
    reasons: Counter = field(default_factory=Counter)
    dataset_bytes: int = 0
    topk_bytes: int = 0
    topk_entries: int = 0
    buckets: int = 0

    def add(self, table: pa.Table, share: float | None) -> None:
        index = table.column("prompt_index").to_numpy()
        self.rows += table.num_rows
        self.prompts += len(np.unique(index))
        self.tokens += int(
            pc.sum(pc.list_value_length(table.column("completion_ids"))).as_py() or 0
        )
        self.reasons.update(table.column("finish_reason").to_pylist())
        if share is not None:
            self.sampled += sum(sampled_prompt(int(i), share) for i in index)
        size, entries = topk_bytes(table)
        self.topk_bytes += size
        self.topk_entries += entries


def _chunk_files(out: Path, config: Mapping[str, Any], records: Sequence[Mapping]) -> list[Path]:
    fp, count = config["fingerprint"], int(config["shard_count"])
    return sorted(
        f
        for rec in records
        for f in shard_dir(out, fp, rec["shard_index"], count).glob("chunk-*.parquet")
    )


def _bucket_edges(planned: np.ndarray, files: Sequence[Path], budget: int) -> np.ndarray:
    """The first prompt index of each bucket: consecutive planned prompts, as many as fit
    `budget` bytes at the Arrow bytes per prompt of the first chunk."""
    if not len(planned):
        return np.zeros(1, np.int64)  # one bucket, so unplanned rows still reach the check
    if not files:
        return planned[:1]
    probe = pq.read_table(files[0])
    per_prompt = max(1, probe.nbytes // max(1, len(np.unique(probe.column("prompt_index")))))
    size = max(1, budget // per_prompt, -(-len(planned) // MAX_BUCKETS))
    return planned[::size]


def _merge_to(
    tmp: Path,
    out: Path,
    config: Mapping[str, Any],
    records: Sequence[Mapping],
    budget: int,
    shard_bytes: int,
) -> MergeStats:
    """Both passes: the dataset's files and `state.json` written into `tmp`."""
    schema = chunk_schema(int(config["topk_logprobs"]), "chat_turns" in config)
    num_samples = int(config["sampling"]["num_samples"])
    share = config["sampling"].get("sampled_share")
    planned = np.unique(np.fromiter((i for r in records for i in r["prompt_indices"]), np.int64))
    files = _chunk_files(out, config, records)
    edges = _bucket_edges(planned, files, budget)
    buckets = tmp / "buckets"
    buckets.mkdir(parents=True)
    _scatter(files, schema, edges, buckets)
    pa.default_memory_pool().release_unused()
    stats = MergeStats(buckets=len(edges))
    bad: list[int] = []
    with DatasetWriter(tmp, schema, config, shard_bytes) as writer:
        for b, table in _sorted_buckets(buckets, schema, len(edges)):
            lo = edges[b]
            hi = edges[b + 1] if b + 1 < len(edges) else np.iinfo(np.int64).max
            want = planned[(planned >= lo) & (planned < hi)]
            bad += _plan_mismatch(table.column("prompt_index").to_numpy(), want, num_samples)
            stats.add(table, share)
            writer.write(table)
            del table
            pa.default_memory_pool().release_unused()  # the allocator keeps freed pages else
    shutil.rmtree(buckets)
    if bad:
        raise RuntimeError(
            f"merge of {str(out)!r}: rows do not match the plan for prompts {sorted(bad)[:10]} "
            f"({len(bad)} prompts); delete {out / 'chunks'} and rerun"
        )
    stats.dataset_bytes = writer.bytes
    return stats


def _scatter(files: Sequence[Path], schema: pa.Schema, edges: np.ndarray, dest: Path) -> None:
    """Pass 1: each chunk's rows appended to the stream file of their bucket."""
    sinks: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    try:
        for f in files:
            table = as_storage(pq.read_table(f), schema)
            index = table.column("prompt_index").to_numpy()
            # below the first edge (a prompt not planned): bucket 0, where the check names it
            bucket = np.maximum(np.searchsorted(edges, index, "right") - 1, 0)
            for b in np.unique(bucket):
                if b not in sinks:
                    sinks[int(b)] = pa.ipc.new_stream(str(dest / f"{b:05d}.arrow"), schema)
                sinks[int(b)].write_table(table.filter(pa.array(bucket == b)))
    finally:
        for sink in sinks.values():
            sink.close()


def _sorted_buckets(dest: Path, schema: pa.Schema, n: int) -> Iterator[tuple[int, pa.Table]]:
    """Pass 2: each bucket read whole, sorted, and removed, in prompt order."""
    order = [("prompt_index", "ascending"), ("sample_index", "ascending")]
    for b in range(n):
        path = dest / f"{b:05d}.arrow"
        if not path.exists():  # no rows landed there: the plan check names its prompts
            yield b, schema.empty_table()
            continue
        with pa.OSFile(str(path)) as f:
            table = pa.ipc.open_stream(f).read_all()
        path.unlink()
        yield b, table.sort_by(order)


def _plan_mismatch(got: np.ndarray, want: np.ndarray, num_samples: int) -> list[int]:
    """Prompts whose row count is not `num_samples` (missing, extra, or not planned)."""
    have = Counter(got.tolist())
    planned = set(want.tolist())
    bad = {i for i in planned if have.get(i, 0) != num_samples}
    return sorted(bad | {int(i) for i in have if i not in planned})


class DatasetWriter:
    """Tables appended to the Arrow files of a `datasets` dataset (`load_from_disk` reads it):
    `data-XXXXX-of-NNNNN.arrow` files of about `shard_bytes`, `dataset_info.json` and, last,
    `state.json`, as `Dataset.save_to_disk` writes them, without holding the dataset."""

    def __init__(
        self, folder: Path, schema: pa.Schema, config: Mapping[str, Any], shard_bytes: int
    ) -> None:
        import datasets

        self.folder, self.shard_bytes = folder, shard_bytes
        self.features = datasets.Features.from_arrow_schema(schema)
        self.info = datasets.DatasetInfo(
            description=json.dumps(config, sort_keys=True), features=self.features
        )
        self.schema = self.features.arrow_schema
        self.files: list[Path] = []
        self.sink: pa.ipc.RecordBatchStreamWriter | None = None
        self.in_file = 0
        self.bytes = 0

    def __enter__(self) -> DatasetWriter:
        return self

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if self.sink is None or self.in_file >= self.shard_bytes:
            self._next_file()
        assert self.sink is not None
        self.sink.write_table(table.cast(self.schema))
        self.in_file += table.nbytes
        self.bytes += table.nbytes

    def _next_file(self) -> None:
        if self.sink is not None:
            self.sink.close()
        path = self.folder / f".part-{len(self.files):05d}.arrow"
        self.files.append(path)
        self.sink = pa.ipc.new_stream(str(path), self.schema)
        self.in_file = 0

    def __exit__(self, kind, *_: Any) -> None:
        if self.sink is None and kind is None:
            self._next_file()  # 0 rows: one empty file, as save_to_disk writes
        if self.sink is not None:
            self.sink.close()
        if kind is not None:
            return
        n = len(self.files)
        names = [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
        for path, name in zip(self.files, names):
            os.replace(path, self.folder / name)
        self.info.write_to_directory(str(self.folder))
        state = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": json.loads(self.info.description)["fingerprint"],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        (self.folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def _move_dataset(tmp: Path, out: Path) -> None:
    """The merged files over `output_dir`'s, state.json last; older data files removed."""
    new = {f.name for f in tmp.iterdir()}
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "state.json"):
        os.replace(f, out / f.name)
    for f in out.glob("data-*.arrow"):
        if f.name not in new:
            f.unlink()
    tmp.rmdir()


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if os.uname().sysname == "Darwin" else int(peak) * 1024


def _result(
    config: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    stats: MergeStats,
    wall_seconds: float | None,
) -> dict[str, Any]:
    new_tokens = sum(int(r["new_tokens"]) for r in records)
    gen_seconds = sum(float(r["generation_seconds"]) for r in records)
    # shards run side by side (ranks, processes, array tasks): the slowest one's time is the
    # span the tokens took; the sum is shard-seconds (reported as generation_seconds)
    span = max((float(r["generation_seconds"]) for r in records), default=0.0)
    walls = [float(r["wall_seconds"]) for r in records]
    prompt_stats = config["prompt_stats"]
    share = config["sampling"].get("sampled_share")  # a mixed set: how many rows were sampled
    mixed = {"sampled_samples": stats.sampled} if share is not None else {}
    return {
        "output_dir": config["output_dir"],
        "fingerprint": config["fingerprint"],
        "backend": config.get("backend", "hf"),  # the one field that tells the engines apart
        "prompts_in_source": prompt_stats["total"],
        "prompts": stats.prompts,
        "samples_per_prompt": int(config["sampling"]["num_samples"]),
        "samples": stats.rows,
        **mixed,
        "skipped_long_prompts": prompt_stats["skipped_long"],
        "skipped_empty_prompts": prompt_stats["skipped_empty"],
        "truncated_long_prompts": prompt_stats["truncated_long"],
        "tokens_generated": stats.tokens,
        "finish_reasons": {
            "eos": stats.reasons.get("eos", 0),
            "length": stats.reasons.get("length", 0),
        },
        # What the last run of each shard generated (a resumed run: only the missing chunks).
        "new_tokens": new_tokens,
        "generation_seconds": round(gen_seconds, 3),
        "tokens_per_s": round(new_tokens / span, 1) if span else 0.0,
        "wall_seconds": round(max([*walls, wall_seconds or 0.0]), 3),
        "storage": storage_record(stats),
        "shard_count": len(records),
        "shards": [
            {k: v for k, v in r.items() if k not in ("prompt_indices", "fingerprint")}
            for r in records
        ],
        "merged_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def storage_record(stats: MergeStats) -> dict[str, Any]:
    """Bytes per stored position and per top-k entry, and the merging process's peak RSS
    (the whole process: in a generate run it includes the target)."""
    return {
        "dataset_bytes": stats.dataset_bytes,
        "bytes_per_position": round(stats.dataset_bytes / stats.tokens, 2)
        if stats.tokens
        else None,
        "topk_bytes_per_entry": (
            round(stats.topk_bytes / stats.topk_entries, 3) if stats.topk_entries else None
        ),
        "merge_buckets": stats.buckets,
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
    }
