"""The README's set-up commands are the ones CI runs, so they cannot rot unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    """One installs and tests, one installs and runs the pipeline; each makes the venv itself."""
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds), "each set-up command is one line"
    for cmd in cmds:
        assert cmd.startswith("[ -d .venv ] || python3 -m venv .venv;"), cmd
        assert "pip install torch==2.13.0" in cmd and 'pip install -e ".[dev]"' in cmd
    # the quick suite on every core up to 4 (pytest-xdist; tests/conftest.py gives each worker
    # one thread), so a 2-core CI box runs it in about half the time
    assert cmds[0].endswith('pytest -m "not slow and not gpu" -n auto --maxprocesses 4')
    assert cmds[1].endswith("&& specdistill")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_cmd = _readme_commands()[0]
    assert test_cmd in ci, f".ci/run must run the README's test command verbatim: {test_cmd}"


def test_ci_stops_when_the_readme_command_fails_before_its_tests():
    """`set -e` ignores a failure inside an && list unless it is the last command: the line after
    the README's command must check the list's status, or a failed install skips the tests."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    at = ci.index(_readme_commands()[0])
    after = next(line for line in ci[at + 1 :] if line.strip() and not line.startswith("#"))
    assert after.startswith("rc=$?;") and 'exit "$rc"' in after, after
