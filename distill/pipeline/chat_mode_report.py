"""summary.md's table by chat mode: the drafter validated in each mode its traffic is asked in.

A run with `chat_modes` (pipeline/chat_modes.py; Qwen3's thinking switch) trains the drafter on
every mode's rows and validates it in each: `validate` in the served mode, `validate_<label>` in
the others. A drafter trained with thinking on and served with it off is the field's most
reported mismatch, so the run's summary puts the modes side by side instead of leaving the other
mode's figures in a report nobody opens.
"""

from __future__ import annotations

from typing import Any

from specdistill.decode.validate.report import mode_value

HEADER = [
    "| chat mode (template arguments) | step | tau greedy / sampled | alpha greedy / sampled |",
    "| --- | --- | --- | --- |",
]


def _kwargs(v: dict[str, Any]) -> dict[str, Any]:
    dataset = (v.get("config") or {}).get("dataset") or {}
    return dict(dataset.get("chat_template_kwargs") or {})


def _pair(v: dict[str, Any], name: str) -> str:
    got = [mode_value(v, mode, name) for mode in ("greedy", "sampling")]
    return " / ".join("-" if g is None else f"{g:.2f}" for g in got)


def chat_mode_lines(stages: dict[str, dict]) -> list[str]:
    """The table (with a title line), or [] unless the distilled drafter was validated under
    two or more different template arguments; the served mode (`validate`) first."""
    served = stages.get("validate")
    if not served or not _kwargs(served):
        return []
    rows = [("validate", served)] + [
        (name, v) for name, v in sorted(stages.items())
        if name.startswith("validate_") and name != "validate_base"
        and _kwargs(v) and _kwargs(v) != _kwargs(served)
    ]  # fmt: skip
    if len(rows) < 2:
        return []
    lines = ["", "The distilled drafter in each chat mode (served first):", "", *HEADER]
    for name, v in rows:
        args = ", ".join(f"{k}: {val}" for k, val in _kwargs(v).items())
        served_mark = " (served)" if name == "validate" else ""
        lines.append(f"| {args}{served_mark} | {name} | {_pair(v, 'tau')} | {_pair(v, 'alpha')} |")
    return lines
