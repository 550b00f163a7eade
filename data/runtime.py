"""Helpers every floor needs, written once: the CLI error contract, device/dtype/threads, padding.

They live on the ground floor (`data/`) so `decode/` and `distill/` import them without
importing each other.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def specdistill_home() -> Path:
    """Where the toy world, converted GGUF models and built drafters are cached."""
    return Path(os.environ.get("SPECDISTILL_HOME", Path.home() / ".cache" / "specdistill"))


class ConfigError(ValueError):
    """Bad user input, reported with the config field at fault and how to fix it."""


class CheckFailed(RuntimeError):
    """A stage's own check of what it produced failed (the message says what differs and what
    was, or was not, written): one `error:` line with exit status 1, since nothing about the
    settings is at fault and a traceback would only point into the check."""


CHECK_FAILED_EXIT = 1


def node_get(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg[key]` for a DictConfig, a dict or an attribute object (None: the default)."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def run_or_exit(run: Callable[[Any], T], cfg: Any) -> T:
    """Run a stage for a CLI: a ConfigError becomes one `error: ...` line and exit status 2.

    Hydra would print it with a traceback; bad input deserves the field and the fix, alone.
    A write the environment refuses (disk full, quota, read-only, permission; see
    `specdistill.data.io.describe_fault`) is one `error:` line too, with exit status 3, and a
    failed check of the stage's own output (`CheckFailed`) one with exit status 1.
    """
    from specdistill.data.io import IO_FAULT_EXIT, describe_fault

    try:
        return run(cfg)
    except ConfigError as e:
        message, status = str(e), 2
    except CheckFailed as e:
        message, status = str(e), CHECK_FAILED_EXIT
    except (OSError, RuntimeError) as e:
        message, status = describe_fault(e), IO_FAULT_EXIT
        if message is None:
            raise
    # Printed once the failed run's frames are gone (a progress bar closes as they go), so the
    # error is the last line.
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def parse_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """`auto` means bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16}
    table |= {"bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ConfigError(f"dtype={name!r} is not known; use one of auto, {', '.join(table)}")
    return table[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA device is visible; use device=cpu or auto")
    return dev


# torch's own thread count at import: its cores (OMP_NUM_THREADS and the affinity mask honoured)
_CORES = torch.get_num_threads()


def _thread_count(setting: Any, field: str, auto: int) -> int | None:
    """N threads for `auto` | `default` (None: leave torch's) | N, or a ConfigError naming `field`."""
    if setting in (None, "default"):
        return None
    n = auto if setting == "auto" else setting
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{field}={setting!r} must be auto, default or a positive integer")
    return n


def set_threads(setting: Any, device: torch.device, *, field: str = "threads") -> None:
    """`auto`: one CPU thread; `default` (or null): torch's own choice (every core); N: N threads.

    One thread is for a shared, busy machine, where a second thread's synchronisation stalls
    small steps, and for one-thread shard processes (generate's `processes`). On a quiet machine
    every core is faster for the target alone and for speculative decoding alike, so the
    decoding stages take torch's own count. The count changes speed only: decoded tokens and
    acceptance figures are the same at any count (tests/decode/test_determinism.py).
    """
    n = _thread_count(setting, field, auto=1)
    if device.type == "cpu" and n is not None:
        torch.set_num_threads(n)


@contextmanager
def kept_threads() -> Iterator[None]:
    """Restore the thread count after the block: a stage's setting (generate threads=auto: 1)
    must not slow the next stage of an in-process pipeline."""
    steps = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(steps)


def pad_rows(
    rows: Sequence[Sequence[int] | torch.Tensor], pad_id: int, *, side: str = "left"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of a batch of token rows, padded to the longest row.

    Decoder-only generation needs `left` (every row ends at the last column); training and
    scoring batches read positions from the start of each row, so they pad on the `right`.
    """
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if not len(r):
            continue
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols] = torch.as_tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def eos_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a completion (chat models often have several)."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range of repeated timings: how every report states a wall-clock figure."""
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def number_as_float(value: Any) -> Any:
    """A float for a number (ints too, not bools); anything else (`auto`, None, a bad value)
    unchanged, for the settings' check to accept or name."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def required(node: Any, key: str, field: str = "") -> Any:
    """`node[key]` (a key set to null stays None: for some settings null means something, e.g.
    `threads: null`). A stage key's default has one home, the stage's YAML in conf/, which every
    composed config carries; a hand-built node without the key is one ConfigError naming the
    field (`field` is the node's dotted path, e.g. `eval`), not a second default written here."""
    if node is None or key not in node:
        name = f"{field}.{key}" if field else key
        raise ConfigError(
            f"{name} is missing: its default is in the stage's YAML (conf/); compose the "
            f"stage's config from it, or set {name}"
        )
    return node[key]


def cache_argument(model: Any) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` in newer `transformers`,
    `past_key_values` in older forwards and remote code."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
