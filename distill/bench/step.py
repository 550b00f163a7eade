"""Benchmark: distill-stage training throughput and peak RSS, variant by variant.

    python -m specdistill.distill.bench.step --data SEQKD_DIR pair=smollm2 \\
        --variant live:data.use_topk=false,freeze_embeddings=false \\
        --variant topk:freeze_embeddings=false --variant topk+freeze:
    python -m specdistill.distill.bench.step --data CHAT_SEQKD_DIR pair=smollm2 --steps 32 \\
        --variant plain: --variant grouped:group_by_length=16     # mixed-length chat rows

Each variant is the distill stage's own `prepare` + `train_step` (the code a run executes),
composed from conf/distill.yaml with the shared overrides and the variant's own, in a fresh
process (so peak RSS is the variant's): one warm-up step, then `--steps` timed optimizer steps.
tokens/s counts the completion tokens trained on (the loss's tokens), as the stage reports it;
each variant's ratio to the first is printed beside it (with `--repeats N`, the variants run
N rounds interleaved and the median is compared: a shared CPU's slow spells hit all alike) (`group_by_length`: time a whole number
of groups, since each group starts with its longest rows).
The held-out set is one row of the same data (no target is loaded for it when the rows carry
stored top-k), so only training is timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(data: str, steps: int, threads: int, overrides: list[str]) -> dict:
    """Time `steps` optimizer steps of the distill stage after one warm-up step."""
    import torch
    from hydra import compose, initialize_config_module

    from specdistill.distill.train import stage

    torch.set_num_threads(threads)
    base = [
        f"data.path={data}",
        "eval.source=path",
        f"eval.path={data}",
        "eval.limit=1",
        "logger=none",
        "device=cpu",
        f"output_dir={data}-bench-step",
    ]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[*base, *overrides])
    tr = stage.prepare(cfg)
    stage.train_step(tr, 0)
    tokens, t0 = 0, time.perf_counter()
    for step in range(1, steps + 1):
        tokens += stage.train_step(tr, step)["tokens"]
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "target_loaded": tr.target is not None,
        "topk": tr.topk,
        "frozen_params": tr.frozen_params,
        "threads": threads,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a generate-stage dataset (with top-k rows)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every variant, interleaved (A B A B): the median tokens/s is reported, "
        "so a machine that slows for a while moves every variant alike",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:KEY=VALUE,KEY=VALUE (distill overrides of that variant)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    ap.add_argument("overrides", nargs="*", help="distill overrides shared by every variant")
    args = ap.parse_args(argv)
    if args.one is not None:
        own = [o for o in args.one.split(",") if o]
        print(json.dumps(measure(args.data, args.steps, args.threads, args.overrides + own)))
        return
    specs = [spec.partition(":")[::2] for spec in args.variant or ["default:"]]
    runs: dict[str, list[dict]] = {name: [] for name, _ in specs}
    for _ in range(max(1, args.repeats)):
        for name, own in specs:
            cmd = [sys.executable, "-m", __spec__.name, "--data", args.data, "--one", own]
            cmd += ["--steps", str(args.steps), "--threads", str(args.threads), *args.overrides]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"error: variant {name} failed:\n{out.stderr[-2000:]}")
            row = {"variant": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            runs[name].append(row)
            print(json.dumps(row), flush=True)
    rows = [_median_row(runs[name]) for name, _ in specs]
    first = rows[0]["tokens_per_s"]
    print(
        f"| variant | tokens/s (median; range) | x {rows[0]['variant']} | peak RSS MB | "
        "target loaded | frozen params |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['tokens_per_s']} ({r['range']}) | "
            f"{r['tokens_per_s'] / first:.2f} | {r['peak_rss_mb']} | {r['target_loaded']} | "
            f"{r['frozen_params']} |"
        )


def _median_row(runs: list[dict]) -> dict:
    """A variant's runs as one row: the median tokens/s, its range, the largest peak RSS."""
    speeds = sorted(r["tokens_per_s"] for r in runs)
    mid = len(speeds) // 2
    median = speeds[mid] if len(speeds) % 2 else (speeds[mid - 1] + speeds[mid]) / 2
    return {
        **runs[0],
        "tokens_per_s": round(median, 1),
        "range": f"{speeds[0]}-{speeds[-1]}",
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


if __name__ == "__main__":
    main()
