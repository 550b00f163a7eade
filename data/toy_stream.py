"""Prompt sources for online adaptation's shifted stream: stdlib parts the toy world never saw.

The toy world trains both models and draws every training prompt from the stdlib minus the
folders in `specdistill.data.toy._SKIP_DIRS`. Three of those are whole top-level packages:
CPython's regression suite `test/` and the tkinter applications `idlelib/` and `turtledemo/`.
They make the shifted segments of the default stream: code neither model was trained on and
no training prompt comes from, in two styles unlike the library code the drafter was distilled
on (unittest classes full of asserts; GUI widgets, events and canvases). Prompts are extracted
with the toy world's own `extract_prompts` (signature + docstring) and cached under
`$SPECDISTILL_HOME` (parsing ~1000 files takes seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

from specdistill.data.io import atomic_write_text
from specdistill.data.toy import _prompt_set, _stdlib_dir, read_jsonl, specdistill_home

# Bump when the extraction below changes, so stale caches are not reused.
STREAM_VERSION = 1
# Disjoint groups of top-level stdlib packages, none of them in the toy world's corpus.
STREAM_GROUPS: dict[str, tuple[str, ...]] = {
    "stdlib-tests": ("test",),
    "stdlib-gui": ("idlelib", "turtledemo"),
}
_MAX_PROMPTS = 2000


def group_files(group: str) -> list[Path]:
    """The .py files of a group's top-level packages, sorted (deterministic)."""
    if group not in STREAM_GROUPS:
        raise KeyError(group)
    base = _stdlib_dir()
    files: list[Path] = []
    for package in STREAM_GROUPS[group]:
        files.extend(sorted((base / package).rglob("*.py")))
    return files


def group_prompts(group: str) -> list[dict]:
    """Prompt rows (prompt, completion, module, name) of one group; cached after the first call."""
    import sys

    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    cache = specdistill_home() / "toy_stream" / f"{group}-v{STREAM_VERSION}-{py}.jsonl"
    if cache.exists():
        return read_jsonl(cache)
    rows = _prompt_set(group_files(group), _MAX_PROMPTS)
    atomic_write_text(cache, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows
