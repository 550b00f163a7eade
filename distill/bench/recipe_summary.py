"""Rank the recipes of a recipe sweep by decode-time acceptance in each serving mode.

    python -m specdistill.distill.bench.recipe_summary multirun/recipe_sweep

Each sub-folder of the sweep is one recipe; every validate `report.json` under it is one
prompt set (named from the report's dataset). Figures per recipe and prompt set: greedy alpha /
tau / measured speedup and sampling alpha / tau / speedup, read from the report's `modes` (or
from a greedy and a sampling report side by side). Writes summary.md, summary.json and
summary.png (greedy vs sampling alpha: the trade, one point per recipe and prompt set).

Balanced: the recipe whose worse mode is best, where a mode's score is its alpha over the best
alpha any recipe reached in that mode, averaged over the prompt sets (1 = matches the best).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from specdistill.data.io import atomic_write_json, atomic_write_text, read_json
from specdistill.decode.validate.report import mode_value

log = logging.getLogger(__name__)
MODES = ("greedy", "sampling")
FIGURES = ("alpha", "tau", "speedup")


def prompt_set_name(report: dict[str, Any]) -> str:
    """A short name for the prompt set a validate report decoded."""
    ds = (report.get("config") or {}).get("dataset") or {}
    source = ds.get("source")
    if source == "toy":
        name = f"toy-{ds.get('split') or 'test'}"
    elif source == "toy_stream":
        name = str(ds.get("group"))
    elif ds.get("path"):
        name = Path(str(ds["path"])).stem
    else:
        name = str(ds.get("name") or source or "prompts")
    return name.replace("_", "-")


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per recipe: {recipe, sets: {set: {mode: {alpha, tau, speedup, ...}}}}."""
    rows = []
    for run in sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir()):
        sets: dict[str, dict[str, dict[str, Any]]] = {}
        for rep in sorted(run.rglob("report.json")):
            r = read_json(rep)
            per_mode = sets.setdefault(prompt_set_name(r), {})
            for mode in MODES:
                figs = {k: mode_value(r, mode, k) for k in FIGURES}
                if figs["alpha"] is None or (mode in per_mode and figs["speedup"] is None):
                    continue  # keep a timed figure over an untimed one
                t = (
                    0.0
                    if mode == "greedy"
                    else (r.get("modes") or {}).get(mode, r).get("temperature")
                )
                per_mode[mode] = {**figs, "temperature": t}
        if sets:
            pj = run / "pipeline.json"
            recipe = read_json(pj).get("summary", {}).get("recipe") if pj.is_file() else None
            rows.append({"recipe": run.name, "recipe_config": recipe, "sets": sets})
    return rows


def _alpha(row: dict, s: str, mode: str) -> float | None:
    return ((row["sets"].get(s) or {}).get(mode) or {}).get("alpha")


def scores(rows: list[dict[str, Any]], sets: list[str]) -> dict[str, dict[str, float]]:
    """Per recipe and mode: mean over prompt sets of alpha / best alpha in that mode and set."""
    best = {
        (s, m): max((a for r in rows if (a := _alpha(r, s, m)) is not None), default=None)
        for s in sets
        for m in MODES
    }
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        sc = {}
        for m in MODES:
            rel = [
                a / best[s, m] for s in sets if (a := _alpha(r, s, m)) is not None and best[s, m]
            ]
            if len(rel) == len(sets):
                sc[m] = sum(rel) / len(rel)
        if len(sc) == len(MODES):
            sc["worse_mode"] = min(sc.values())
            out[r["recipe"]] = sc
    return out


def _cell(x: Any, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def summary_markdown(sweep_dir: Path, rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    sets = sorted({s for r in rows for s in r["sets"]})
    sc = scores(rows, sets)
    lines = [f"# Recipe sweep: {sweep_dir}", ""]
    for s in sets:
        temps = {
            r["sets"][s].get("sampling", {}).get("temperature") for r in rows if s in r["sets"]
        }
        t = "/".join(str(x) for x in sorted(t for t in temps if t is not None)) or "?"
        lines += [
            f"## Prompt set `{s}` (decode-time; sampling at temperature {t})",
            "",
            "| recipe | greedy alpha | greedy tau | greedy speedup | sampling alpha | "
            "sampling tau | sampling speedup |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        ranked = sorted(
            (r for r in rows if s in r["sets"]), key=lambda r: -(_alpha(r, s, "greedy") or -1)
        )
        for r in ranked:
            g, p = r["sets"][s].get("greedy", {}), r["sets"][s].get("sampling", {})
            lines.append(
                f"| {r['recipe']} | {_cell(g.get('alpha'), '.3f')} | {_cell(g.get('tau'), '.2f')} | "
                f"{_cell(g.get('speedup'), '.2f')}x | {_cell(p.get('alpha'), '.3f')} | "
                f"{_cell(p.get('tau'), '.2f')} | {_cell(p.get('speedup'), '.2f')}x |"
            )
        lines.append("")
    picks: dict[str, Any] = {}
    if sc:
        for m in MODES:
            picks[m] = max(sc, key=lambda k: sc[k][m])
        picks["balanced"] = max(sc, key=lambda k: sc[k]["worse_mode"])
        lines += [
            "## Picks (alpha relative to the best recipe of each mode, mean over prompt sets)",
            "",
            "| pick | recipe | greedy | sampling |",
            "| --- | --- | --- | --- |",
        ]
        for pick, name in picks.items():
            lines.append(
                f"| best {pick} | {name} | {sc[name]['greedy']:.3f} | {sc[name]['sampling']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines), {"sets": sets, "rows": rows, "scores": sc, "picks": picks}


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Greedy alpha (x) vs sampling alpha (y): one marker per prompt set, each recipe labelled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", path)
        return False
    sets = sorted({s for r in rows for s in r["sets"]})
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for s, marker in zip(sets, "os^Dv"):
        pts = [(r["recipe"], _alpha(r, s, "greedy"), _alpha(r, s, "sampling")) for r in rows]
        pts = [p for p in pts if p[1] is not None and p[2] is not None]
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], marker=marker, label=s)
        for name, x, y in pts:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set(xlabel="decode-time alpha, greedy", ylabel="decode-time alpha, sampling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_summary(sweep_dir: Path) -> str:
    rows = collect(sweep_dir)
    text, data = summary_markdown(sweep_dir, rows)
    atomic_write_text(Path(sweep_dir) / "summary.md", text + "\n")
    atomic_write_json(Path(sweep_dir) / "summary.json", data)
    if rows:
        plot(rows, Path(sweep_dir) / "summary.png")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    args = ap.parse_args(argv)
    if not args.sweep_dir.is_dir():
        raise SystemExit(f"recipe_summary: {args.sweep_dir} is not a folder")
    print(write_summary(args.sweep_dir))


if __name__ == "__main__":
    main()
