"""Where the offline copies of public data sets live: `data/sets/` inside the package
(instruction prompts, GSM8K, MT-Bench, a ShareGPT fixture; each with its license, the sources in
its README), shipped as package data so a clone and an install both run every shipped config.

Ready configs keep the hub names a user loads (`dataset.source=hub`) and name these copies for
machines without a hub: `dataset.path: local:gsm8k/test.jsonl` resolves here. The folder is
`$SPECDISTILL_DATA` when set (other copies, laid out the same way), else the package's own: the
resolver never looks outside the installed package, so a run reads the data its code shipped with.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdistill.data.runtime import ConfigError

PREFIX = "local:"
PACKAGED = Path(__file__).resolve().parent / "sets"  # pyproject.toml's package-data ships it


def local_data_dir() -> Path:
    """The folder `local:` paths resolve into, or one error line saying how to point at one."""
    env = os.environ.get("SPECDISTILL_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"SPECDISTILL_DATA={env!r} is not a folder: point it at a copy laid out as "
                f"{PACKAGED}, or unset it to use that one"
            )
        return path
    if not (PACKAGED / "README.md").is_file():
        raise ConfigError(
            f"the packaged data copies ({PACKAGED}) are missing: reinstall specdistill, set "
            "SPECDISTILL_DATA=/path/to/copies, or use the set's hub name (dataset.source=hub)"
        )
    return PACKAGED


def resolve_path(path: str) -> str:
    """`local:REL` -> the offline copy's absolute path; any other path unchanged."""
    if not isinstance(path, str) or not path.startswith(PREFIX):
        return path
    full = local_data_dir() / path[len(PREFIX) :]
    if not full.exists():
        raise ConfigError(
            f"dataset.path={path!r}: {full} does not exist in the offline data copies"
        )
    return str(full)
