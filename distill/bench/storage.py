"""Benchmark: Seq-KD storage at scale, the compact layout against the one it replaced.

    python -m specdistill.distill.bench.storage --positions 100000 1000000

For each size it writes a synthetic generate run (random rows: `--prompt-len` prompt tokens,
`--completion-len` completion tokens, the target's top-`--k` at each, in chunks of
`--chunk-size` prompts over `--shards` shards), once in each layout, and measures, each in a
fresh child process (peak RSS = the child's `ru_maxrss`, its imports included):

- merge: `merge_shards` (a bucket sort within `--budget-mb`, 8 by default so that the
  smallest size spans several buckets too: the merge's memory is set by the budget, 256 MB
  in the stage) against the replaced merge
  (int64 ids and fp32 log-probs in nested lists, every chunk concatenated and sorted in memory,
  then `save_to_disk`);
- load: what one distill rank of 2 does with the rows over an epoch: open the dataset and
  collate each of its micro-batches (`--micro-batch` rows), lazily (`SeqKDRows`) against the
  replaced `load_seqkd` (every row as Python lists, on every rank).

It prints bytes per stored (id, log-prob) entry and per position, peak RSS per phase and size,
and each phase's RSS ratio largest size / smallest, and writes `--output` (JSON). RSS counts
the pages a process touched, memory-mapped dataset pages included (the kernel may drop those:
they are the page cache's), so the load phase also reports its peak anonymous RSS (sampled
after each micro-batch): the memory a rank holds itself. Timings are this machine's and not the point.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specdistill.data.generate.shards import CONFIG_FILE
from specdistill.data.generate.storage import topk_bytes
from specdistill.data.generate.synthetic import LAYOUTS, synthetic_run
from specdistill.data.io import atomic_write_json

# --- the phases, each run in a child process -------------------------------------------------


def merge_replaced(out: Path) -> None:
    """The merge storage.py replaced: every chunk in memory, concatenated, sorted, saved."""
    import datasets
    from datasets.table import InMemoryTable

    config = json.loads((out / CONFIG_FILE).read_text())
    files = sorted((out / "chunks" / config["fingerprint"]).glob("*/chunk-*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    table = table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
    datasets.Dataset(InMemoryTable(table)).save_to_disk(str(out / "merged"))


def merge_compact(out: Path, budget_bytes: int) -> dict[str, Any]:
    from specdistill.data.generate.merge import merge_shards

    return merge_shards(out, budget_bytes=budget_bytes)["storage"]


def load_rows(path: Path, layout: str, micro_batch: int) -> dict[str, Any]:
    """One rank of 2 over an epoch: open the rows, collate each of its micro-batches."""
    from specdistill.distill.train.data import Example, StreamSpec, collate, load_seqkd

    if layout == "compact":
        rows = load_seqkd(path)
    else:  # load_seqkd before seqkd_rows.py: every row as Python lists
        import datasets

        ds = datasets.load_from_disk(str(path))
        rows = [
            Example(
                list(r["prompt_ids"]), list(r["completion_ids"]), r["topk_ids"], r["topk_logprobs"]
            )
            for r in ds
        ]
    stream = StreamSpec(len(rows), micro_batch, world_size=2, grad_accum=1, seed=0)
    steps, tokens, anon = len(rows) // (micro_batch * 2), 0, anon_rss_mb()
    for step in range(steps):
        exs = [rows[i] for i in stream.indices(stream.global_micro_index(step, 0, 0))]
        batch = collate(exs, 0, 4096)
        tokens += int(batch["loss_mask"].sum())
        anon = max(anon, anon_rss_mb())
    return {"micro_batches": steps, "loss_tokens": tokens, "peak_anon_mb": anon}


def anon_rss_mb() -> float:
    """This process's anonymous resident memory now (Linux; 0 elsewhere): its RSS without
    file-backed pages (shared libraries, memory-mapped data)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    path = Path(args.dir)
    if args.phase == "merge":
        info = merge_compact(path, args.budget_mb << 20) if args.layout == "compact" else {}
        if args.layout != "compact":
            merge_replaced(path)
    else:
        data = path if args.layout == "compact" else path / "merged"
        info = load_rows(data, args.layout, args.micro_batch)
    from specdistill.data.generate.merge import peak_rss_bytes

    print(
        json.dumps(
            {"peak_rss_mb": peak_rss_bytes() / 2**20, "seconds": time.perf_counter() - t0, **info}
        )
    )


def _run_child(phase: str, layout: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "specdistill.distill.bench.storage", "--child", phase]
    cmd += ["--layout", layout, "--dir", str(folder), "--budget-mb", str(args.budget_mb)]
    cmd += ["--micro-batch", str(args.micro_batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{phase} ({layout}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _entry_bytes(folder: Path, layout: str) -> dict[str, float]:
    """Bytes per stored (id, log-prob) entry and per position, from the merged Arrow files."""
    data = folder if layout == "compact" else folder / "merged"
    total, topk, entries, positions = 0, 0, 0, 0
    for f in sorted(data.glob("data-*.arrow")):
        with pa.memory_map(str(f)) as src:
            table = pa.ipc.open_stream(src).read_all()
        size, count = topk_bytes(table)
        total, topk, entries = total + table.nbytes, topk + size, entries + count
        positions += sum(len(c.flatten()) for c in table.column("topk_ids").chunks)
    return {"bytes_per_entry": topk / entries, "bytes_per_position": total / positions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdistill.distill.bench.storage")
    parser.add_argument("--positions", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=200)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--budget-mb", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--output", default="outputs/bench/storage.json")
    parser.add_argument("--child", choices=("merge", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, default="compact", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.phase = args.child
        return _child(args)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    try:
        for positions in sorted(args.positions):
            prompts = max(2, positions // args.completion_len)
            for layout in LAYOUTS:
                folder = root / f"{layout}-{positions}"
                synthetic_run(
                    folder,
                    prompts,
                    prompt_len=args.prompt_len,
                    completion_len=args.completion_len,
                    k=args.k,
                    chunk_size=args.chunk_size,
                    shards=args.shards,
                    layout=layout,
                )
                merge = _run_child("merge", layout, folder, args)
                load = _run_child("load", layout, folder, args)
                rows.append(
                    {
                        "positions": prompts * args.completion_len,
                        "layout": layout,
                        **_entry_bytes(folder, layout),
                        "merge_rss_mb": merge["peak_rss_mb"],
                        "merge_s": merge["seconds"],
                        "load_rss_mb": load["peak_rss_mb"],
                        "load_anon_mb": load["peak_anon_mb"],
                        "load_s": load["seconds"],
                    }
                )
                shutil.rmtree(folder)
                print(_line(rows[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = _ratios(rows)
    for line in ratios:
        print(line)
    record = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "layout", "dir")},
        "rows": rows,
        "ratios": ratios,
    }
    atomic_write_json(Path(args.output), record)


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['positions']:>9,} positions  {r['layout']:<8}  {r['bytes_per_entry']:.2f} B/entry  "
        f"{r['bytes_per_position']:.1f} B/position  merge {r['merge_rss_mb']:.0f} MB "
        f"({r['merge_s']:.1f} s)  load {r['load_rss_mb']:.0f} MB, anon {r['load_anon_mb']:.0f} MB "
        f"({r['load_s']:.1f} s)"
    )


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Peak RSS at the largest size / at the smallest, per layout and phase."""
    out = []
    for layout in LAYOUTS:
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["positions"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        for key, what in (("merge_rss", "merge"), ("load_rss", "load"), ("load_anon", "load anon")):
            ratio = hi[f"{key}_mb"] / lo[f"{key}_mb"]
            out.append(
                f"{layout:<8} {what} peak RSS {hi['positions']:,} / {lo['positions']:,} "
                f"positions: {ratio:.2f}x"
            )
    return out


if __name__ == "__main__":
    main()
