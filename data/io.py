"""Atomic writes, and the write faults the environment causes (disk full, quota, read-only).

A killed job leaves either the old file or the new one, never half of one. A write the
environment refuses becomes a `WriteFault` (an OSError carrying the path and, where known, the
bytes needed) once the partial temp files are removed; `run_or_exit` prints it as one `error:`
line with exit status 3 (`IO_FAULT_EXIT`): nothing is wrong with the settings, free space (or
fix the permissions) and rerun, and the finished work is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

IO_FAULT_EXIT = 3
IO_FAULTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
# Writers that report errno only in their message: pyarrow, safetensors ("os error 28").
_ERRNO_IN_TEXT = re.compile(r"(?:errno|os error)\s*(\d+)", re.IGNORECASE)
_FULL = 1 << 20  # a filesystem with less free than this (or than the write needs) is full


class WriteFault(OSError):
    """A write the environment refused: errno, the path and (where known) the bytes needed."""

    def __init__(self, code: int, path: str | Path, needed: int | None = None) -> None:
        super().__init__(code, IO_FAULTS.get(code, os.strerror(code)), str(path))
        self.needed = needed


def _free_bytes(path: str | Path) -> tuple[int, Path] | None:
    """Free bytes on the filesystem holding `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists():
            try:
                free = shutil.disk_usage(q).free
                while q.parent != q and q.parent.stat().st_dev == q.stat().st_dev:
                    q = q.parent  # name the filesystem by its mount point
            except OSError:
                return None
            return free, q
    return None


def fault_errno(exc: BaseException, path: str | Path | None = None, needed=None) -> int | None:
    """The errno of an environment write fault behind `exc`, or None (a bug: re-raise it).

    torch.save reports a full disk as a RuntimeError with no errno ("unexpected pos ..."):
    a RuntimeError while the filesystem is full (less free than the write needs) counts too.
    """
    if isinstance(exc, OSError) and exc.errno in IO_FAULTS:
        return exc.errno
    if isinstance(exc, WriteFault):
        return exc.errno
    m = _ERRNO_IN_TEXT.search(str(exc))
    if m and int(m.group(1)) in IO_FAULTS:
        return int(m.group(1))
    if isinstance(exc, RuntimeError) and path is not None:
        free = _free_bytes(path)
        if free is not None and free[0] < max(needed or 0, _FULL):
            return errno.ENOSPC
    return None


@contextlib.contextmanager
def guard_write(
    path: str | Path, needed: int | None = None, cleanup: tuple[str | Path, ...] = ()
) -> Iterator[None]:
    """On any failure remove `cleanup` (temp files or folders); a write fault of the
    environment is re-raised as WriteFault(path, needed), anything else as it was."""
    try:
        yield
    except BaseException as e:
        code = fault_errno(e, path, needed)
        for c in cleanup:
            c = Path(c)
            if c.is_dir() and not c.is_symlink():
                shutil.rmtree(c, ignore_errors=True)
            else:
                c.unlink(missing_ok=True)
        if code is None or isinstance(e, WriteFault):
            raise
        raise WriteFault(code, path, needed) from e


def param_bytes(model: Any) -> int:
    """Bytes of a module's parameters (tied ones once): what save_pretrained writes."""
    return sum(t.numel() * t.element_size() for t in model.parameters())


def _human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def describe_fault(exc: BaseException) -> str | None:
    """One line for an environment I/O fault (None for any other exception)."""
    code = fault_errno(exc)
    if code is None:
        return None
    path = getattr(exc, "filename", None)
    where = f" writing {path}" if isinstance(exc, WriteFault) else f": {path}" if path else ""
    needed = getattr(exc, "needed", None)
    room = []
    if needed:
        room.append(f"needs about {_human(needed)}")
    free = _free_bytes(path) if path else None
    if free is not None and code in (errno.ENOSPC, errno.EDQUOT):
        room.append(f"{_human(free[0])} free on {free[1]}")
    detail = f" ({', '.join(room)})" if room else ""
    fix = (
        "free some space (or point output_dir elsewhere)"
        if code in (errno.ENOSPC, errno.EDQUOT)
        else "make it writable (or point output_dir elsewhere)"
    )
    return (
        f"{IO_FAULTS[code]}{where}{detail}: {fix}, then rerun; finished work is kept "
        "(generate resumes its chunks; distill and online continue their latest checkpoint)"
    )


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write to a temp file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    data = text.encode("utf-8")
    with guard_write(path, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, paths and tensors/numpy scalars as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def replace_dir(tmp: Path, path: Path) -> Path:
    """Rename a finished temp folder over `path`: the old folder is moved aside, then removed.

    A reader (or a killed job) sees the old folder or the new one, never half of either; if the
    rename fails the old folder is put back.
    """
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def build_once(root: Path, marker: str, build: Callable[[Path], Any]) -> Path:
    """`root`, built on first use and cached: `build(tmp)` fills a temp sibling, which is then
    renamed into place (`replace_dir`). Once across processes: a file lock, and a process that
    waited for it finds `root / marker` (the file a finished build writes last) and returns.
    Never half there: any failure removes the temp folder, and disk full & co. end as one line
    (`guard_write`, exit 3)."""
    if (root / marker).exists():
        return root
    from filelock import FileLock

    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / marker).exists():  # built by another process while we waited
            return root
        tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        with guard_write(root, cleanup=(tmp,)):
            build(tmp)
            replace_dir(tmp, root)
    return root
