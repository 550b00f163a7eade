"""Fixtures for the generate stage's tests: its config composed exactly as the CLI composes it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

# Small enough that a whole run (load, generate, merge) takes a second or two on toy-tiny.
QUICK = [
    "pair=toy-tiny",
    "max_new_tokens=6",
    "batch_size=4",
    "chunk_size=4",
    "dataset.limit=10",
    "progress=false",
]


def compose_generate(output_dir: str | Path, *overrides: str) -> DictConfig:
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="generate", overrides=[*QUICK, f"output_dir={output_dir}", *overrides]
        )


@pytest.fixture
def generate_cfg(toy_tiny, tmp_path) -> Callable[..., DictConfig]:
    """`generate_cfg("max_new_tokens=4", out=...)`: a quick toy-tiny generate config."""

    def make(*overrides: str, out: str | Path | None = None) -> DictConfig:
        return compose_generate(out or tmp_path / "gen", *overrides)

    return make
