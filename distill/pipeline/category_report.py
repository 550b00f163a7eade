"""summary.md's figures by benchmark set and category: every drafter the run validated on the
same prompts (base, distilled, `compare_drafters`) side by side, both serving modes.

Reads the `categories` rows of each validate report (decode/validate: one row per set, per
(set, category) and `all`, per mode), so it works on a run made here or on Slurm alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdistill.decode.validate.categories import plot_by_category
from specdistill.decode.validate.report import positions

COMPARED = "validate_drafter_"  # distill/pipeline/plan.py names compare_drafters steps so


def drafters(stages: dict[str, dict]) -> list[tuple[str, dict]]:
    """(name, validate report) of each drafter validated on the run's validate prompts."""
    named = [("base", stages.get("validate_base")), ("distilled", stages.get("validate"))]
    named += [(k[len(COMPARED) :], v) for k, v in stages.items() if k.startswith(COMPARED)]
    return [(n, v) for n, v in named if v and v.get("categories")]


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return str(row.get("set")), str(row.get("category"))


def category_table(stages: dict[str, dict]) -> list[str]:
    """One table per serving mode: a row per set and category, tau and alpha per drafter, and
    the distilled drafter's acceptance by draft position."""
    named = drafters(stages)
    if not named:
        return []
    lines = ["", "## By benchmark and category", ""]
    names = [n for n, _ in named]
    by = {n: {(_key(r), r.get("mode")): r for r in v["categories"]} for n, v in named}
    order = list(dict.fromkeys(_key(r) for _, v in named for r in v["categories"]))
    modes = list(dict.fromkeys(r.get("mode") for _, v in named for r in v["categories"]))
    main = "distilled" if "distilled" in names else names[-1]
    for mode in modes:
        lines += [
            f"{mode}: tau at the serving K (tokens per round, bonus included) / the drafter's alpha",
            "",
            "| set | category | prompts | "
            + " | ".join(f"tau {n}" for n in names)
            + " | "
            + " | ".join(f"alpha {n}" for n in names)
            + f" | acceptance by position, {main} |",
            "| --- | --- | --- | " + " | ".join("---" for _ in names * 2) + " | --- |",
        ]
        for key in order:
            rows = [by[n].get((key, mode)) for n in names]
            if not any(rows):
                continue
            first = next(r for r in rows if r)
            mine = by[main].get((key, mode)) or {}
            set_name, category = key
            lines.append(
                f"| {set_name} | {'' if category in (set_name, 'None') else category} | "
                f"{first.get('prompts')} | "
                + " | ".join(_num(r, "tau") for r in rows)
                + " | "
                + " | ".join(_num(r, "alpha", 3) for r in rows)
                + f" | {positions(mine.get('acceptance_by_position')) if mine else '-'} |"
            )
        lines.append("")
    return lines


def _num(row: dict[str, Any] | None, key: str, digits: int = 2) -> str:
    if not row or row.get(key) is None:
        return "-"
    return f"{float(row[key]):.{digits}f}"


def plot_categories(stages: dict[str, dict], path: Path) -> bool:
    """report_categories.png: tau by set (and category), one bar per drafter, a panel per mode."""
    return plot_by_category([(n, v["categories"]) for n, v in drafters(stages)], path)
