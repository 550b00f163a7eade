"""Where the offline copies of public data sets live (`shared/data/`: instruction prompts,
GSM8K, MT-Bench, a ShareGPT fixture; each with its license and source in its README).

Ready configs keep the hub names a user loads (`dataset.source=hub`) and name these copies for
machines without a hub: `dataset.path: local:gsm8k/test.jsonl` resolves here. The folder is
`$SPECDISTILL_DATA`, else the nearest `shared/data` beside the checkout or above it.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdistill.data.runtime import ConfigError

PREFIX = "local:"


def shared_data_dir() -> Path:
    """The folder of the offline data copies, or one error line saying how to point at it."""
    env = os.environ.get("SPECDISTILL_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise ConfigError(f"SPECDISTILL_DATA={env!r} is not a folder: point it at shared/data")
        return path
    here = Path(__file__).resolve()
    for parent in here.parents:
        for candidate in (parent / "shared" / "data", parent.parent / "shared" / "data"):
            if (candidate / "README.md").is_file():
                return candidate
    raise ConfigError(
        "the offline data copies (shared/data) were not found beside or above this checkout: "
        "set SPECDISTILL_DATA=/path/to/shared/data, or use the set's hub name (dataset.source=hub)"
    )


def resolve_path(path: str) -> str:
    """`local:REL` -> the offline copy's absolute path; any other path unchanged."""
    if not isinstance(path, str) or not path.startswith(PREFIX):
        return path
    full = shared_data_dir() / path[len(PREFIX) :]
    if not full.exists():
        raise ConfigError(
            f"dataset.path={path!r}: {full} does not exist in the offline data copies"
        )
    return str(full)
