"""What a generate run reports: `GenerateResult`, for one shard's run or for a merge.

Apart from stage.py so the local shard processes (shard_processes.py), which the stage starts,
build the same result without importing the stage back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.io import read_json


@dataclass
class GenerateResult:
    """What one process did; `result` is result.json when this process saw the merge done."""

    output_dir: str
    shard_index: int
    shard_count: int
    prompts: int
    samples: int
    chunks_generated: int
    chunks_resumed: int
    new_tokens: int
    tokens_per_s: float
    wall_seconds: float
    merged: bool
    result: dict[str, Any] | None = None


def merged_result(out: Path, result: dict[str, Any], wall: float) -> GenerateResult:
    """The result of a merge (`merge_shards`'s `result`) that this process generated nothing
    for: a `merge_only` run, or the local processes' parent before it adds its shards' figures."""
    config = read_json(out / "generation_config.json")
    return GenerateResult(
        output_dir=str(out),
        shard_index=0,
        shard_count=int(config["shard_count"]),
        prompts=int(result["prompts"]),
        samples=int(result["samples"]),
        chunks_generated=0,
        chunks_resumed=0,
        new_tokens=0,
        tokens_per_s=0.0,
        wall_seconds=round(wall, 3),
        merged=True,
        result=result,
    )
