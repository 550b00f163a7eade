"""Rank the runs of a loss sweep by held-out alpha (and greedy agreement for greedy decoding).

    python -m specdistill.distill.train.sweep_summary multirun/loss_sweep

Reads every `*/result.json` under the folder and writes `summary.md` and `summary.json` there.
DistillSpec found the best divergence depends on task and decoding mode; this picks it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdistill.data.io import atomic_write_json, atomic_write_text, read_json


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    for res in sorted(Path(sweep_dir).glob("*/result.json")):
        r = read_json(res)
        loss = r.get("loss", {})
        name = loss.get("name", "?") + (f"({loss['beta']})" if loss.get("name") == "jsd" else "")
        rows.append(
            {
                "run": res.parent.name,
                "loss": name,
                "alpha_before": r["alpha_before"],
                "alpha_after": r["alpha_after"],
                "best_alpha": r.get("best_alpha", r["alpha_after"]),
                "greedy_before": r.get("greedy_agreement_before"),
                "greedy_after": r.get("greedy_agreement_after"),
                "steps": r.get("steps"),
                "drafter_path": r.get("drafter_path"),
            }
        )
    return rows


def rank(rows: list[dict], key: str = "alpha_after") -> list[dict]:
    return sorted(rows, key=lambda r: -(r[key] if r[key] is not None else float("-inf")))


def write_summary(sweep_dir: Path) -> str:
    """Write summary.md/json for what has finished so far; return the markdown."""
    rows = collect(sweep_dir)
    by_alpha = rank(rows, "alpha_after")
    by_greedy = rank(rows, "greedy_after")
    lines = [
        f"# Loss sweep: {sweep_dir}",
        "",
        "Ranked by held-out alpha after training (sampling). Greedy decoding: see greedy column.",
        "",
        "| rank | loss | alpha before | alpha after | greedy before | greedy after | steps |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(by_alpha, 1):
        lines.append(
            f"| {i} | {r['loss']} | {r['alpha_before']:.4f} | {r['alpha_after']:.4f} | "
            f"{r['greedy_before']:.4f} | {r['greedy_after']:.4f} | {r['steps']} |"
        )
    if rows:
        lines += [
            "",
            f"Best for sampling: **{by_alpha[0]['loss']}** (alpha {by_alpha[0]['alpha_after']:.4f});"
            f" best for greedy: **{by_greedy[0]['loss']}** "
            f"(agreement {by_greedy[0]['greedy_after']:.4f}).",
        ]
    text = "\n".join(lines) + "\n"
    atomic_write_text(Path(sweep_dir) / "summary.md", text)
    atomic_write_json(
        Path(sweep_dir) / "summary.json",
        {"by_alpha": by_alpha, "by_greedy": by_greedy},
    )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    args = ap.parse_args()
    if not args.sweep_dir.is_dir():
        raise SystemExit(f"sweep_summary: {args.sweep_dir} is not a folder")
    print(write_summary(args.sweep_dir), end="")


if __name__ == "__main__":
    main()
