"""`data.io.build_once`: the cached builds (toy world, drafters from a target, GGUF conversions)
are built once across processes and never left half there."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest

from specdistill.data.io import WriteFault, build_once


def _writer(calls: list[Path], pause: float = 0.0):
    def build(tmp: Path) -> None:
        calls.append(tmp)
        tmp.mkdir(parents=True)
        (tmp / "weights.bin").write_bytes(b"w")
        time.sleep(pause)
        (tmp / "done.json").write_text("{}")  # the marker, written last

    return build


def test_builds_on_first_use_then_reads_the_cache(tmp_path):
    root = tmp_path / "cache" / "thing"
    calls: list[Path] = []
    assert build_once(root, "done.json", _writer(calls)) == root
    assert (root / "weights.bin").read_bytes() == b"w" and len(calls) == 1
    assert calls[0] != root and not calls[0].exists()  # built aside, then renamed into place
    assert build_once(root, "done.json", _writer(calls)) == root
    assert len(calls) == 1


def test_concurrent_callers_build_once(tmp_path):
    root = tmp_path / "thing"
    calls: list[Path] = []
    build = _writer(calls, pause=0.3)
    threads = [
        threading.Thread(target=build_once, args=(root, "done.json", build)) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (root / "done.json").exists()


def test_a_failed_build_leaves_nothing_and_a_rerun_builds(tmp_path):
    root = tmp_path / "thing"

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "weights.bin").write_bytes(b"half")
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        build_once(root, "done.json", broken)
    assert not root.exists() and not list(tmp_path.glob("thing.tmp-*"))

    def disk_full(tmp: Path) -> None:
        tmp.mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteFault):  # one `error:` line and exit 3 at the command line
        build_once(root, "done.json", disk_full)
    assert not root.exists() and not list(tmp_path.glob("thing.tmp-*"))
    calls: list[Path] = []
    build_once(root, "done.json", _writer(calls))
    assert (root / "done.json").exists() and len(calls) == 1


def test_a_folder_without_its_marker_is_rebuilt(tmp_path):
    root = tmp_path / "thing"
    root.mkdir()
    (root / "weights.bin").write_bytes(b"stale")  # a build from before markers, or a copy cut short
    calls: list[Path] = []
    build_once(root, "done.json", _writer(calls))
    assert len(calls) == 1 and (root / "weights.bin").read_bytes() == b"w"
