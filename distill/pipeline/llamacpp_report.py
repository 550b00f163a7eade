"""summary.md's llama.cpp table (`llamacpp=true`): the base and distilled drafters as llama.cpp
serves them, from the validate reports' `llamacpp` sections (decode/validate/engines/llamacpp.py,
its `summary_lines`), our decoder's figures beside."""

from __future__ import annotations

from typing import Any

from specdistill.decode.validate.engines import ENGINES

SIDES = (("base", "validate_base"), ("distilled", "validate"))


def llamacpp_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    """The table, or nothing when no validate step ran in llama.cpp."""
    found = [(label, (stages.get(step) or {}).get("llamacpp")) for label, step in SIDES]
    return ENGINES["llamacpp"].summary_lines([(label, v) for label, v in found if v])
