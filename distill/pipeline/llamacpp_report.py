"""summary.md's llama.cpp table (`llamacpp=true`): the base and distilled drafters as llama.cpp
serves them, from the validate reports' `llamacpp` sections (decode/validate/llamacpp_engine.py),
our decoder's figures beside."""

from __future__ import annotations

from typing import Any

from specdistill.decode.validate.llamacpp_engine import SUMMARY_HEAD, summary_caption, summary_rows

SIDES = (("base", "validate_base"), ("distilled", "validate"))


def llamacpp_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    """The table, or nothing when no validate step ran in llama.cpp."""
    found = [(label, (stages.get(step) or {}).get("llamacpp")) for label, step in SIDES]
    found = [(label, v) for label, v in found if v]
    if not found:
        return []
    rows = [row for label, v in found for row in summary_rows(v, label)]
    return ["", summary_caption(found[-1][1]), "", *SUMMARY_HEAD, *rows]
