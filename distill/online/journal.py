"""The served run's journal: every answer the engine gave, written before the stage uses it.

A checkpoint of the drafter, its optimizer and the buffer is large and written every few
updates; a request is answered every second or so. So each answer (and each update's guard
outcome and swap) is appended to `journal.jsonl` as one line, flushed and fsynced, as soon as
it arrives. A stage killed between checkpoints resumes from its last checkpoint and replays
the journal's answers instead of asking the server again: no request is answered twice, and
the updates in between are recomputed from the same answers with the same seeds. A torn last
line (killed mid-write) is dropped: that request had not been used yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Journal:
    """Append-only answers by request id and update outcomes by update index."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: dict[int, dict[str, Any]] = {}
        self.updates: dict[int, dict[str, Any]] = {}

    def load(self) -> Journal:
        """What an earlier run of this config wrote (nothing when the file is absent)."""
        if not self.path.is_file():
            return self
        kept = 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    break  # a torn last line: never used
                if not line.endswith(b"\n"):
                    break
                book = self.requests if rec["kind"] == "request" else self.updates
                book[int(rec["index"])] = rec
                kept += len(line)
        if kept != self.path.stat().st_size:  # cut the torn line: the next append follows
            with open(self.path, "r+b") as f:
                f.truncate(kept)
        return self

    def reset(self) -> None:
        """A fresh run: the journal starts empty."""
        self.path.unlink(missing_ok=True)
        self.requests, self.updates = {}, {}

    def append(self, kind: str, index: int, record: dict[str, Any]) -> None:
        """One line, on disk before it returns."""
        rec = {"kind": kind, "index": int(index), **record}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        (self.requests if kind == "request" else self.updates)[int(index)] = rec
