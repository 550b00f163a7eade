"""The toy world's corpus: the Python standard library's own `.py` files, read offline.

One split rule (`is_held_out`) serves every prompt set built on the stdlib (the toy world, its
long-context sets, online adaptation's shifted stream): a module is held out by a hash of its
relative path. Folders in `SKIP_DIRS` are never read, so the shifted stream can draw on them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo", "ensurepip"}


def stdlib_dir() -> Path:
    """This interpreter's standard library: the corpus is on every machine, no download."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(key: str) -> bool:
    """The split rule, one place for every prompt set: a document (a stdlib module's relative
    path, or a long document's key) is held out (test) for 1 in 10 hashes, else train."""
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 10 == 0


def corpus_files() -> tuple[list[Path], list[Path]]:
    """Stdlib modules split into (train, held-out) by a hash of the relative path."""
    base = stdlib_dir()
    train, held = [], []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        (held if is_held_out(rel.as_posix()) else train).append(path)
    return train, held


def read_source(path: Path) -> str | None:
    """A file's text, or None for the few stdlib files that are not UTF-8 or not readable."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_texts(paths: list[Path]) -> list[str]:
    """The readable, non-blank texts of `paths`, in order (what the models train on)."""
    return [t for t in (read_source(p) for p in paths) if t and t.strip()]
