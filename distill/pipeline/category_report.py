"""summary.md's figures by benchmark set and category: every drafter the run validated on the
same prompts (base, distilled, `compare_drafters`) side by side, both serving modes.

Reads the `categories` rows of each validate report (decode/validate: one row per set, per
(set, category) and `all`, per mode), so it works on a run made here or on Slurm alike.
"""

from __future__ import annotations

from pathlib import Path

from specdistill.decode.validate.categories import compare_table, plot_by_category

COMPARED = "validate_drafter_"  # distill/pipeline/plan.py names compare_drafters steps so


def drafters(stages: dict[str, dict]) -> list[tuple[str, dict]]:
    """(name, validate report) of each drafter validated on the run's validate prompts."""
    named = [("base", stages.get("validate_base")), ("distilled", stages.get("validate"))]
    named += [(k[len(COMPARED) :], v) for k, v in stages.items() if k.startswith(COMPARED)]
    return [(n, v) for n, v in named if v and v.get("categories")]


def category_table(stages: dict[str, dict]) -> list[str]:
    """One table per serving mode: a row per set and category, tau and alpha per drafter, and
    the distilled drafter's acceptance by draft position."""
    named = [(n, v["categories"]) for n, v in drafters(stages)]
    main = "distilled" if any(n == "distilled" for n, _ in named) else None
    return compare_table(named, main)


def plot_categories(stages: dict[str, dict], path: Path) -> bool:
    """report_categories.png: tau by set (and category), one bar per drafter, a panel per mode."""
    return plot_by_category([(n, v["categories"]) for n, v in drafters(stages)], path)
