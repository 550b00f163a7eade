"""The engines validate runs a pair in, one module each under one protocol (base.py).

`ENGINES` lists them in the order their preflights run and their report sections stand; `ours`
is always first and every other engine stands beside it. `engines` (conf/validate.yaml) picks
among SELECTABLE; `hf_assisted` is its own switch. Adding an engine is one module with an
`ENGINE` (its settings, preflight, run, report rows and summary lines) and one line here.
"""

from __future__ import annotations

from typing import Any

from specdistill.data.runtime import ConfigError, required
from specdistill.decode.validate.engines import hf_assisted, llamacpp, ours, vllm
from specdistill.decode.validate.engines.base import Engine

ENGINES: dict[str, Engine] = {e.ENGINE.name: e.ENGINE for e in (ours, hf_assisted, vllm, llamacpp)}
SELECTABLE = ("ours", "vllm", "llamacpp")  # `engines`; hf_assisted: its own switch


def parse_engines(cfg: Any) -> tuple[str, ...]:
    """`engines`: which engines validate runs; ours always (vLLM and llama.cpp beside it)."""
    raw = required(cfg, "engines")
    names = [raw] if isinstance(raw, str) else list(raw or [])
    unknown = [n for n in names if n not in SELECTABLE]
    if unknown or "ours" not in names:
        raise ConfigError(
            f"engines={names}: use [ours], [ours,vllm] or [ours,llamacpp] (another engine's "
            "figures are reported beside our decoder's, on the same prompts)"
        )
    return tuple(dict.fromkeys(names))


def chosen(names: tuple[str, ...], hf_assisted: bool) -> list[Engine]:
    """The engines to run, in ENGINES' order: `names` and HF assisted generation when on."""
    wanted = {*names, *(["hf_assisted"] if hf_assisted else [])}
    return [e for name, e in ENGINES.items() if name in wanted]


def run_order(engines: list[Engine]) -> list[Engine]:
    """Ours first, then the rest; an engine that takes over the process runs last."""
    return sorted(engines, key=lambda e: (e.name != "ours", e.runs_last))
