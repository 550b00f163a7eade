"""Validate by benchmark set and category: tau, acceptance by position and alpha for each.

p = target, q = drafter. A drafter that helps on code may do nothing for chat, so one average
over a mixed benchmark hides what a user deploying it for their traffic needs. Each prompt of a
chat benchmark carries its set (a mixture member's label, e.g. mt_bench) and category (MT-Bench's
writing, math, ...). From validate's own decodes (no extra decoding), each serving mode gets a
row per (set, category), per set (category `all`) and over everything (set `all`): prompts,
tau, acceptance by position, alpha and the drafter's own alpha, with the measured speedup for
what it is (this machine's, per set, where prompts are decoded one at a time). Batched decodes
(`batch_size` > 1, several prompts a forward: the cheap way to measure acceptance on a CPU)
report by category from the counters the decoder keeps per row. The aggregation is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdistill.data.prompt_record import Prompt
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.validate.modes import TimedPass, merge, positions

ALL = "all"


def labels(prompts: Sequence[Prompt], default_set: str) -> list[tuple[str, str]] | None:
    """Each prompt's (set, category); None when no prompt names a category or a source (a plain
    prompt set: the headline is its only row). In a set without categories (or whose category
    is its own name, like a mixture member's) every prompt is the set's `all`; in a set with
    some, a prompt without one is `other`."""
    if not any(p.category is not None or p.source is not None for p in prompts):
        return None
    named = [
        (s, p.category if p.category not in (None, s) else None)
        for p in prompts
        for s in [p.source or default_set]
    ]
    with_cats = {s for s, c in named if c is not None}
    return [(s, c if c is not None else ("other" if s in with_cats else ALL)) for s, c in named]


def groups(keys: Sequence[tuple[str, str]]) -> list[tuple[str, str, list[int]]]:
    """(set, category, prompt indices) for each category, each set's `all` and the overall
    `all`, in the order the prompts first name them (a set with one category gets no extra
    `all` row: it would repeat the category's)."""
    out: list[tuple[str, str, list[int]]] = []
    sets = list(dict.fromkeys(s for s, _ in keys))
    for s in sets:
        cats = list(dict.fromkeys(c for t, c in keys if t == s))
        for c in cats:
            out.append((s, c, [i for i, k in enumerate(keys) if k == (s, c)]))
        if len(cats) > 1:
            out.append((s, ALL, [i for i, k in enumerate(keys) if k[0] == s]))
    if len(sets) > 1:
        out.append((ALL, ALL, list(range(len(keys)))))
    return out


def category_figures(idx: Sequence[int], passes: Sequence[TimedPass]) -> dict[str, Any]:
    """One serving mode's figures over the prompts `idx` (in prompt order, batches in order),
    from the first timed repeat's decodes (acceptance needs no repeat). Acceptance comes from
    each prompt's own counters, so batched decodes report by category too; this machine's
    speedup needs each prompt timed alone (batch 1), else it is None."""
    first = passes[0]
    rows = [r for o in first.spec_outs for r in o.rows()]
    spec = merge([rows[i] for i in idx])
    speedup = None
    if all(len(o.tokens) == 1 for o in first.spec_outs):  # batch i = prompt i
        base_s = sum(first.base_seconds[i] for i in idx)
        spec_s = sum(first.spec_seconds[i] for i in idx)
        base_tok = emitted_tokens([first.base_outs[i] for i in idx])
        spec_tok = emitted_tokens([first.spec_outs[i] for i in idx])
        rate = (spec_tok / max(spec_s, 1e-9)) / max(base_tok / max(base_s, 1e-9), 1e-9)
        speedup = round(rate, 3)  # this machine's, first repeat
    return {
        "prompts": len(idx),
        "tau": round(spec.tau, 3),
        "acceptance_by_position": spec.acceptance_at(),
        "alpha": round(spec.alpha, 4),
        "drafter_alpha": round(spec.drafter_alpha, 4),
        "trials": spec.trials,
        "speedup": speedup,
    }


def category_rows(
    keys: Sequence[tuple[str, str]], passes: dict[str, Sequence[TimedPass]]
) -> list[dict[str, Any]]:
    """report.json's `categories`: a row per (set, category) and `all`, per serving mode."""
    rows = []
    for mode, mode_passes in passes.items():
        for s, c, idx in groups(keys):
            rows.append(
                {"set": s, "category": c, "mode": mode, **category_figures(idx, mode_passes)}
            )
    return rows


def label(set_name: str, category: str) -> str:
    """A row's name in tables and plots: the category, its set's name for the set's `all`."""
    return set_name if category in (ALL, "None") else f"{set_name}/{category}"


def category_markdown(rows: list[dict[str, Any]] | None) -> list[str]:
    """report.md's section: one table per serving mode, a row per set and category."""
    if not rows:
        return []
    lines = ["## By benchmark and category", ""]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        lines += [
            f"{mode}:",
            "",
            "| set | category | prompts | tau | alpha | drafter's alpha | acceptance by position "
            "| speedup (this machine) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["mode"] == mode:
                lines.append(
                    f"| {r['set']} | {r['category']} | {r['prompts']} | {r['tau']} | {r['alpha']} "
                    f"| {r['drafter_alpha']} | {positions(r['acceptance_by_position'])} "
                    f"| {'-' if r['speedup'] is None else str(r['speedup']) + 'x'} |"
                )
        lines.append("")
    return lines


def compare_table(named: list[tuple[str, list[dict[str, Any]]]], main: str | None) -> list[str]:
    """Several drafters on the same prompts (`named`: (drafter, category rows)): one table per
    serving mode, a row per set and category, tau and alpha per drafter, and `main`'s (default:
    the last drafter's) acceptance by draft position."""
    named = [(n, rows) for n, rows in named if rows]
    if not named:
        return []
    names = [n for n, _ in named]
    main = main if main in names else names[-1]
    by = {n: {(r["set"], r["category"], r["mode"]): r for r in rows} for n, rows in named}
    order = list(dict.fromkeys((r["set"], r["category"]) for _, rows in named for r in rows))
    modes = list(dict.fromkeys(r["mode"] for _, rows in named for r in rows))
    lines = ["", "## By benchmark and category", ""]
    for mode in modes:
        lines += [
            f"{mode}: tau at the serving K (tokens per round, bonus included) / the drafter's alpha",
            "",
            "| set | category | prompts | " + " | ".join(f"tau {n}" for n in names) + " | "
            + " | ".join(f"alpha {n}" for n in names) + f" | acceptance by position, {main} |",
            "| --- | --- | --- | " + " | ".join("---" for _ in names * 2) + " | --- |",
        ]  # fmt: skip
        for s, c in order:
            rows = [by[n].get((s, c, mode)) for n in names]
            first = next((r for r in rows if r), None)
            if first is None:
                continue
            mine = by[main].get((s, c, mode))
            lines.append(
                f"| {s} | {c} | {first['prompts']} | "
                + " | ".join(_num(r, "tau", 2) for r in rows) + " | "
                + " | ".join(_num(r, "alpha", 3) for r in rows)
                + f" | {positions(mine['acceptance_by_position']) if mine else '-'} |"
            )  # fmt: skip
        lines.append("")
    return lines


def _num(row: dict[str, Any] | None, key: str, digits: int) -> str:
    return "-" if not row or row.get(key) is None else f"{float(row[key]):.{digits}f}"


def plot_by_category(named: list[tuple[str, list[dict[str, Any]]]], path: Any) -> bool:
    """tau by set and category, one bar per drafter (`named`: (drafter, category rows)), a panel
    per serving mode; False when there is nothing to plot or no matplotlib."""
    named = [(n, rows) for n, rows in named if rows]
    if not named:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from pathlib import Path

    modes = list(dict.fromkeys(r["mode"] for _, rows in named for r in rows))
    order = list(dict.fromkeys((r["set"], r["category"]) for _, rows in named for r in rows))
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(max(6, 0.55 * len(order)), 3 * len(modes)), squeeze=False
    )
    width = 0.8 / len(named)
    for ax, mode in zip(axes[:, 0], modes):
        for i, (name, rows) in enumerate(named):
            mine = {(r["set"], r["category"]): r for r in rows if r["mode"] == mode}
            taus = [float((mine.get(k) or {}).get("tau") or 0) for k in order]
            xs = [j + (i - (len(named) - 1) / 2) * width for j in range(len(order))]
            ax.bar(xs, taus, width=width, label=name)
        ax.set_xticks(range(len(order)), [label(*k) for k in order], rotation=40, ha="right",
                      fontsize=8)  # fmt: skip
        ax.set(ylabel="tau (tokens per round)", title=mode)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=8, ncol=len(named))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
