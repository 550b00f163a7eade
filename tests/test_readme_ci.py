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
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds), "each set-up command is one line"
    assert "pip install torch==2.13.0" in cmds[0] and 'pip install -e ".[dev]"' in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in _readme_commands():
        assert cmd in ci, f".ci/run must run the README command verbatim: {cmd}"
