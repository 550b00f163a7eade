"""The GPU part of the pipeline as one prepared run: what a CPU cannot show, in about ten minutes.

    python -m specdistill.distill.bench.gpu_checks --out DIR          # on one CUDA GPU
    .ci/gpu fetch && (device) .ci/gpu run                             # the device tool's way

Every figure comes from the commands a user runs (the stages' own CLIs, the decoder benchmark),
each in its own process with its own time limit, so a section that fails or hangs is reported and
the next one still runs. Sections, written to DIR/gpu_checks.json after each:

- `toy_tau`: the toy pair (toy-tiny, built there) validated at K = 4 on the CPU in fp32 and on
  the GPU in bf16 with the decoder's CUDA graphs (`decoder.compile=auto`): tau and acceptance by
  position side by side. Decoding given weights is reproducible per kernel; bf16 near-ties may
  move a round, so the two are compared, not asserted equal.
- `shapes`: `decode.bench.gpu` on random weights at Llama-3.2-1B's and Llama-3.1-8B's shapes,
  batch 1 and 8: speedup, c, and the target-only decode's share of the memory roofline.
- `distill`: Seq-KD rows generated on the GPU, then a few distill steps of each strategy one GPU
  runs: bf16, packed rows, FSDP2 in one process (torchrun).

DIR/gpu_checks.md is the note's table. `--device cpu` runs the same sections on a CPU at tiny
sizes (tests/distill/test_gpu_checks.py), so the script is exercised where CI runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specdistill.data.io import atomic_write_json, atomic_write_text

SHAPES = ("llama3-1b", "llama3-8b")  # decode/bench/gpu.py's presets of the cluster pairs
TOY = "toy-tiny"
SECTIONS = ("toy_tau", "shapes", "distill")
GAMMA = 4


def _run(cmd: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """One command; its exit status, seconds and log (stdout and stderr) kept in `log`."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"cmd": " ".join(cmd), "rc": code, "seconds": round(time.perf_counter() - t0, 1),
            "tail": tail}  # fmt: skip


def _module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"specdistill.{name}", *args]


def toy_tau(out: Path, device: str, dtype: str, prompts: int) -> dict[str, Any]:
    """validate on the toy pair: the CPU in fp32 beside `device` in `dtype`, same prompts."""
    runs = {}
    for label, dev, dt in (
        ("reference_cpu_fp32", "cpu", "fp32"),
        (f"{device}_{dtype}", device, dtype),
    ):
        folder = out / f"validate_{label}"
        run = _run(_module("decode.validate", f"pair={TOY}", f"output_dir={folder}",
                           f"device={dev}", f"dtype={dt}", f"num_prompts={prompts}",
                           "max_new_tokens=48", f"decoder.gamma={GAMMA}", "hf_assisted=false",
                           "plot=false", "progress=false"),
                   out / f"validate_{label}.log", timeout=240)  # fmt: skip
        report = folder / "report.json"
        if report.is_file():
            r = json.loads(report.read_text())
            greedy = (r.get("modes") or {}).get("greedy") or {}
            run.update(tau=greedy.get("tau"), acceptance_by_position=greedy.get(
                "acceptance_by_position"), speedup=greedy.get("speedup"))  # fmt: skip
        runs[label] = run
    return runs


def shapes(out: Path, device: str, names: list[str], batches: list[int]) -> dict[str, Any]:
    """decode.bench.gpu at each shape: random weights, a layer-skip drafter at alpha ~0.8."""
    runs = {}
    for name in names:
        folder = out / f"bench_{name}"
        run = _run(_module("decode.bench.gpu", "--out", str(folder), "--preset", name,
                           "--batches", *map(str, batches), "--no-hf", "--prompts", "2",
                           "--new-tokens", "128", "--repeats", "2"),
                   out / f"bench_{name}.log", timeout=240)  # fmt: skip
        result = folder / "bench_gpu.json"
        if result.is_file():
            run["bench"] = json.loads(result.read_text())
        runs[name] = run
    return runs


def distill(out: Path, device: str, steps: int) -> dict[str, Any]:
    """Seq-KD rows from the toy target on `device`, then `steps` distill steps per strategy."""
    data = out / "generate"
    runs = {"generate": _run(_module("data.generate", f"pair={TOY}", f"output_dir={data}",
                                     f"device={device}", "dataset.limit=64", "max_new_tokens=32",
                                     "progress=false"),
                             out / "generate.log", timeout=180)}  # fmt: skip
    common = [f"pair={TOY}", f"data.path={data}", f"max_steps={steps}", f"eval_every={steps}",
              f"save_every={steps}", "logger=none", "eval.limit=8", f"device={device}"]  # fmt: skip
    strategies = {
        "bf16": ["mixed_precision=bf16" if device != "cpu" else "mixed_precision=no"],
        "packed": ["pack_sequences=true"],
        "fsdp2_one_process": ["fsdp=true"],
    }
    for name, extra in strategies.items():
        args = [*common, f"output_dir={out / f'distill_{name}'}", *extra]
        cmd = _module("distill.train", *args)
        if name.startswith("fsdp"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "1", "-m", "specdistill.distill.train", *args]  # fmt: skip
        run = _run(cmd, out / f"distill_{name}.log", timeout=180)
        result = out / f"distill_{name}" / "result.json"
        if result.is_file():
            r = json.loads(result.read_text())
            run.update(
                {k: r.get(k) for k in ("steps", "alpha_before", "alpha_after", "best_alpha")}
            )
        runs[name] = run
    return runs


def summary(results: dict[str, Any]) -> str:
    """The note's table: one row per command, its status, seconds and headline figure."""
    lines = [f"# GPU checks: {results.get('device_name')}", "",
             "| section | run | status | seconds | figure |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for section in SECTIONS:
        for name, run in (results.get(section) or {}).items():
            figure = ""
            if section == "toy_tau" and run.get("tau") is not None:
                figure = f"tau {run['tau']:.2f}, by position {run.get('acceptance_by_position')}"
            elif section == "shapes" and run.get("bench"):
                figure = "; ".join(
                    f"batch {b['batch']}: speedup {b.get('speedup')}, tau {b.get('tau')}, "
                    f"c {b.get('c')}, target-only {b.get('baseline_share_of_roofline')} of roofline"
                    for b in run["bench"].get("batches") or []
                )
            elif section == "distill" and run.get("steps") is not None:
                before, after = run.get("alpha_before"), run.get("alpha_after")
                figure = f"{run['steps']} steps, alpha {before:.3f} -> {after:.3f}"
            status = "ok" if run["rc"] == 0 else f"failed ({run['rc']})"
            lines.append(f"| {section} | {name} | {status} | {run['seconds']} | {figure} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at tiny sizes")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=16, help="toy prompts validated per device")
    ap.add_argument("--steps", type=int, default=4, help="distill steps per strategy")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    args = ap.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device: run it on the GPU machine, "
              "or pass --device cpu for a smoke run", file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
    }
    sections = (
        ("toy_tau", lambda: toy_tau(args.out, args.device, args.dtype, args.prompts)),
        ("shapes", lambda: shapes(args.out, args.device, args.shapes, args.batches)),
        ("distill", lambda: distill(args.out, args.device, args.steps)),
    )
    sections = tuple((n, f) for n, f in sections if n in args.sections)
    for name, section in sections:
        results[name] = section()
        atomic_write_json(args.out / "gpu_checks.json", results)
    atomic_write_text(args.out / "gpu_checks.md", summary(results))
    print(summary(results))
    failed = [n for s, _ in sections for n, r in results[s].items() if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
