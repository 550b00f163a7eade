"""Where each shard of the generate stage runs: a launcher rank's device, or local processes.

Under `accelerate launch`/`torchrun` every rank is one shard on its own device (or its share of
the CPU cores). Without a launcher, `processes=N|auto` starts N one-thread shard processes on
this machine (`run_local_processes`): on a CPU, N single-threaded generate loops outrun one
N-threaded loop and never spin-wait on a core another job holds.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.generate.merge import merge_shards
from specdistill.data.generate.result import GenerateResult, merged_result
from specdistill.data.generate.settings import GenerateSettings
from specdistill.data.runtime import ConfigError, resolve_device

RunFn = Callable[[DictConfig], GenerateResult]


def device_for_rank(name: str) -> torch.device:
    """Under a launcher, rank r of a node uses cuda:LOCAL_RANK; CPU ranks split the cores."""
    device = resolve_device(name)
    local = os.environ.get("LOCAL_RANK")
    if device.type == "cuda" and device.index is None and local is not None:
        return torch.device("cuda", int(local))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if device.type == "cpu" and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return device


def usable_cores() -> int:
    """Cores this process may run on (a Slurm allocation or taskset, not the whole node)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_processes(s: GenerateSettings) -> int:
    """Shard processes to start on this machine (`processes`): auto = one per CPU core (at most
    8) for the hf backend on CPU, else 1. Only a run that no launcher or explicit `shard.*`
    already splits starts any: the shards then come from them."""
    if s.processes == "auto":
        cpu = resolve_device(s.device).type == "cpu"
        n = min(usable_cores(), 8) if cpu and s.backend == "hf" else 1
    else:
        n = int(s.processes)
    split = s.shard_index is not None or s.shard_count is not None
    if n > 1 and (split or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return 1
    if n > 1 and s.backend != "hf":
        raise ConfigError(
            f"processes={s.processes} starts local hf shards; backend={s.backend} batches in one "
            "engine: set processes=1"
        )
    return n


def _shard_process(run: RunFn, config: dict[str, Any], results: Any) -> None:
    """A spawned shard of `run_local_processes` (a fresh interpreter: no forked torch state)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    res = run(OmegaConf.create(config))
    results.put((res.chunks_generated, res.chunks_resumed, res.new_tokens, res.tokens_per_s))


def run_local_processes(cfg: DictConfig, n: int, run: RunFn) -> GenerateResult:
    """Shards 1..n-1 in spawned processes, shard 0 here, each through `run` (the stage's own,
    passed in: this module is below the stage), one thread each by default: on a CPU, n
    single-threaded generate loops outrun one n-threaded loop (figures: data/RESULTS.md,
    "Generate throughput") and never spin-wait on a core another job holds. Each shard
    writes its chunks atomically and the last to finish merges, so a killed run resumes with
    the same command."""
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    children = []
    for i in range(1, n):
        node = OmegaConf.merge(cfg, {"shard": {"index": i, "count": n}, "processes": 1})
        child = ctx.Process(
            target=_shard_process,
            args=(run, OmegaConf.to_container(node, resolve=True), results),
            daemon=True,
        )
        child.start()
        children.append((i, child))
    try:
        own = run(OmegaConf.merge(cfg, {"shard": {"index": 0, "count": n}, "processes": 1}))
        for _, child in children:
            child.join()
    except BaseException:
        for _, child in children:
            child.terminate()
        raise
    failed = [(i, c.exitcode) for i, c in children if c.exitcode != 0]
    if failed:
        raise RuntimeError(
            f"generate shards {[i for i, _ in failed]} of {n} failed (exit codes "
            f"{[code for _, code in failed]}); finished chunks are kept: rerun the same command "
            "to resume"
        )
    shards = [(own.chunks_generated, own.chunks_resumed, own.new_tokens, own.tokens_per_s)]
    shards += [results.get(timeout=60) for _ in children]
    out = Path(own.output_dir)
    merged = merge_shards(out, wall_seconds=None)  # no-op when a shard already merged
    res = merged_result(out, merged, time.perf_counter() - t0)
    res.chunks_generated = sum(g for g, _, _, _ in shards)
    res.chunks_resumed = sum(r for _, r, _, _ in shards)
    res.new_tokens = sum(t for _, _, t, _ in shards)
    seconds = max((t / rate for _, _, t, rate in shards if rate), default=0.0)
    res.tokens_per_s = round(res.new_tokens / seconds, 1) if seconds else 0.0
    return res
