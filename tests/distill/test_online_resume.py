"""Online adaptation never loses the drafter: SIGKILL/SIGTERM then the same command again equals
one run (resume=auto, the default); another config's state is refused, resume=false starts over."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ARGS = [
    "pair=toy-tiny",
    "logger=none",
    "stream=[{dataset:toy-test,requests:12},{dataset:stdlib-gui,requests:12}]",
    "max_new_tokens=16",
    "window=4",
    "update_every=2",
    "update_steps=2",
    "guard_every=2",
    "guard_probe=1",
    "gate_relax_margin=0.0",  # the drift-relaxed gate decides both ways, from restored state
    "save_every=2",
    "plot=false",
    "device=cpu",
]


def _cli(out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "specdistill.distill.online", *ARGS, f"output_dir={out}", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _windows(out: Path) -> list[dict]:
    path = out / "online.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wait_then_signal(proc: subprocess.Popen, out: Path, sig: int, windows: int) -> None:
    """Signal once the run checkpointed and served past `windows` windows (mid-stream)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "online_state.pt").exists() and len(_windows(out)) >= windows:
            proc.send_signal(sig)
            break
        time.sleep(0.05)
    proc.communicate(timeout=300)


def _assert_no_request_twice(rows: list[dict], total: int) -> None:
    spans = [(r["window_start"], r["requests"]) for r in rows]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans  # contiguous, disjoint
    assert all(a < b for a, b in spans)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_and_resumed_run_ends_with_the_same_drafter(tmp_path, toy_tiny, sig):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    p = _cli(ref)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-2000:]

    p = _cli(cut)
    _wait_then_signal(p, cut, sig, windows=2)
    assert p.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM)
    assert len(_windows(cut)) < 6, "the run finished before it was interrupted"
    p = _cli(cut)  # the same command: resume=auto continues the stream
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-2000:]

    a = load_file(ref / "drafter" / "model.safetensors")
    b = load_file(cut / "drafter" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(bool((a[k] == b[k]).all()) for k in a)
    rows_ref, rows_cut = _windows(ref), _windows(cut)
    _assert_no_request_twice(rows_cut, 24)
    keys = ("requests", "alpha_adapted", "alpha_frozen", "tau_adapted", "updates", "rollbacks")
    assert [{k: r[k] for k in keys} for r in rows_cut] == [
        {k: r[k] for k in keys} for r in rows_ref
    ]
    result = json.loads((cut / "result.json").read_text())
    assert result["requests"] == 24 and result["updates"] == 12
    ref_result = json.loads((ref / "result.json").read_text())
    assert 0 < result["relaxed_updates"] < result["updates"]
    assert [r["relaxed_updates"] for r in rows_cut] == [r["relaxed_updates"] for r in rows_ref]
    assert result["relaxed_updates"] == ref_result["relaxed_updates"]


def test_saved_state_by_resume_setting(tmp_path):
    import torch

    from specdistill.data.runtime import ConfigError
    from specdistill.distill.online.config import _resume
    from specdistill.distill.online.util import saved_state

    path = tmp_path / "online_state.pt"
    assert saved_state(path, "auto", "fp") is None  # nothing saved yet: a fresh start
    torch.save({"fingerprint": "fp", "pos": 8}, path)
    assert saved_state(path, "auto", "fp")["pos"] == 8
    assert saved_state(path, True, "fp")["pos"] == 8
    assert saved_state(path, False, "fp") is None
    with pytest.raises(ConfigError, match="resume=auto but .* different config .* resume=false"):
        saved_state(path, "auto", "other")
    with pytest.raises(ConfigError, match="resume='yes': use auto"):
        _resume("yes")
    torch.save({"fingerprint": "fp", "run_key": "step-a", "pos": 8}, path)
    assert saved_state(path, "auto", "fp", "step-a")["pos"] == 8
    assert saved_state(path, "auto", "fp", "step-b") is None  # a changed pipeline step: afresh
    assert saved_state(path, True, "fp", "step-b")["pos"] == 8  # true insists
