"""Synthetic generate runs: finished, unmerged runs of random rows in the compact layout or the
one it replaced (int64 ids, fp32 log-probs, nested lists), for the merge's tests and the storage
benchmark (`python -m specdistill.distill.bench.storage`) at sizes no target need generate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specdistill.data.generate.shards import (
    CONFIG_FILE,
    chunk_path,
    fingerprint,
    plan_shard,
    shard_dir,
    write_done,
)
from specdistill.data.generate.storage import chunk_schema, rows_table
from specdistill.data.io import atomic_write_json

LAYOUTS = ("compact", "replaced")  # the storage layout, and the one storage.py replaced


def replaced_schema(topk: int) -> pa.Schema:
    """The layout before storage.py: int64 ids, fp32 log-probs, nested variable lists."""
    compact = chunk_schema(topk)
    fields = []
    for f in compact:
        if f.name in ("prompt_ids", "completion_ids"):
            f = pa.field(f.name, pa.list_(pa.int64()))
        elif f.name == "topk_ids":
            f = pa.field(f.name, pa.list_(pa.list_(pa.int64())))
        elif f.name == "topk_logprobs":
            f = pa.field(f.name, pa.list_(pa.list_(pa.float32())))
        fields.append(f)
    return pa.schema(fields)


def synthetic_run(
    out: Path,
    prompts: int,
    *,
    prompt_len: int,
    completion_len: int,
    k: int,
    chunk_size: int = 64,
    shards: int = 2,
    layout: str = "compact",
    seed: int = 0,
    vocab: int = 49152,
) -> Path:
    """A finished (unmerged) generate run at `out` that `merge_shards` accepts: the config
    record, each shard's chunks (random ids, log-probs sorted like a top-k) and done record."""
    rng = np.random.default_rng(seed)
    config: dict[str, Any] = {
        "stage": "generate",
        "synthetic": {"prompts": prompts, "completion_len": completion_len, "k": k},
        "sampling": {"num_samples": 1},
        "topk_logprobs": k,
        "shard_count": shards,
    }
    config = {"fingerprint": fingerprint(config), **config}
    config |= {
        "prompt_stats": {"total": prompts, "skipped_long": 0, "skipped_empty": 0},
        "output_dir": str(out),
    }
    config["prompt_stats"]["truncated_long"] = 0
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / CONFIG_FILE, config)
    lengths = {i: prompt_len + int(rng.integers(0, 8)) for i in range(prompts)}
    for index in range(shards):
        sdir = shard_dir(out, config["fingerprint"], index, shards)
        plan = plan_shard(lengths, index, shards, chunk_size)
        for c, chunk in enumerate(plan):
            rows = [_row(rng, i, lengths[i], completion_len, k, vocab) for i in chunk]
            _write(chunk_path(sdir, c), rows, k, layout)
        record = {
            "fingerprint": config["fingerprint"],
            "shard_index": index,
            "prompt_indices": [i for chunk in plan for i in chunk],
            "new_tokens": sum(len(chunk) for chunk in plan) * completion_len,
            "generation_seconds": 1.0,
            "wall_seconds": 1.0,
        }
        sdir.mkdir(parents=True, exist_ok=True)
        write_done(sdir, record)
    return out


def _row(rng, i: int, prompt_len: int, completion_len: int, k: int, vocab: int) -> dict:
    ids = rng.integers(0, vocab, size=(completion_len, k), dtype=np.int64)
    lp = np.sort(np.log(rng.dirichlet(np.ones(k * 4), size=completion_len)[:, :k]), axis=-1)
    return {
        "prompt_index": i,
        "sample_index": 0,
        "prompt": f"prompt {i}",
        "prompt_ids": rng.integers(0, vocab, prompt_len).tolist(),
        "completion": f"completion {i}",
        "completion_ids": ids[:, 0].tolist(),
        "finish_reason": "length",
        "topk_ids": ids,
        "topk_logprobs": lp[:, ::-1],
    }


def _write(path: Path, rows: list[dict], k: int, layout: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout == "compact":
        table = rows_table(rows, k)
    else:
        plain = [
            {**r, "topk_ids": r["topk_ids"].tolist(), "topk_logprobs": r["topk_logprobs"].tolist()}
            for r in rows
        ]
        table = pa.Table.from_pylist(plain, schema=replaced_schema(k))
    pq.write_table(table, path)
