"""The offline data copies live in the package (data/sets): every shipped config's `local:`
file resolves there and loads, with SPECDISTILL_DATA unset and without looking anywhere outside
the package (a clone or an install with no `shared/` folder beside it runs every config)."""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import specdistill.data
from specdistill.data.chat_prompts import member_nodes
from specdistill.data.dataset_rows import file_rows
from specdistill.data.local_data import PREFIX, local_data_dir, resolve_path
from specdistill.data.runtime import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(specdistill.data.__file__).resolve().parent
CONFIGS = sorted(p.stem for p in (ROOT / "conf" / "dataset").glob("*.yaml"))


def _dataset(name: str) -> dict[str, Any]:
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        node = compose("validate", overrides=[f"dataset={name}"]).dataset
    return OmegaConf.to_container(node, resolve=False)  # type: ignore[return-value]


def _local_files(node: dict[str, Any]) -> list[tuple[dict[str, Any], str, str]]:
    """(source node, split, local: path) of every local file a dataset node reads."""
    if node.get("source") == "mixture":
        return [f for member in member_nodes(node) for f in _local_files(member)]
    path = node.get("path")
    by_split = path.items() if isinstance(path, dict) else [("train", path)]
    return [(node, s, p) for s, p in by_split if isinstance(p, str) and p.startswith(PREFIX)]


def _shipped_local_files() -> list[tuple[str, dict[str, Any], str, str]]:
    return [(name, *f) for name in CONFIGS for f in _local_files(_dataset(name))]


@pytest.fixture
def looked_at(monkeypatch) -> list[Path]:
    """Every path the resolver asks the file system about, with SPECDISTILL_DATA unset."""
    monkeypatch.delenv("SPECDISTILL_DATA", raising=False)
    seen: list[Path] = []
    for name in ("exists", "is_dir", "is_file"):
        original = getattr(pathlib.Path, name)

        def spy(self, *a, _original=original, **k):
            seen.append(Path(self))
            return _original(self, *a, **k)

        monkeypatch.setattr(pathlib.Path, name, spy)
    return seen


def test_the_chat_configs_name_local_copies():
    names = {name for name, *_ in _shipped_local_files()}
    assert {"instructions", "gsm8k", "mt_bench", "sharegpt", "chat_mix", "chat_bench"} <= names


def test_every_shipped_local_file_resolves_inside_the_package(looked_at):
    files = _shipped_local_files()
    looked_at.clear()  # composing the configs reads the config package
    resolved = [Path(resolve_path(path)) for _, _, _, path in files]
    assert all(p.is_relative_to(PACKAGE / "sets") and p.is_file() for p in resolved)
    assert looked_at and all(p.is_relative_to(PACKAGE) for p in looked_at), [
        p for p in looked_at if not p.is_relative_to(PACKAGE)
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_local_file_loads(name, monkeypatch):
    monkeypatch.delenv("SPECDISTILL_DATA", raising=False)
    for node, split, _ in _local_files(_dataset(name)):
        rows = file_rows(node, node["source"], split)
        assert len(rows) >= 3 and node["field"] in rows[0], (name, split)


def test_the_smollm2_chat_pairs_steps_read_packaged_copies(looked_at, tmp_path):
    """pair=smollm2-chat's steps (its sizing picks chat_mix and chat_bench) read only local
    copies that resolve inside the package."""
    from specdistill.distill.pipeline.plan import build_plan

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose("pipeline", overrides=["pair=smollm2-chat", f"run_dir={tmp_path}"])
    steps = [s for s in build_plan(cfg) if isinstance(s.config.get("dataset"), dict)]
    files = [f for s in steps for f in _local_files(s.config["dataset"])]
    assert {p for *_, p in files} >= {"local:gsm8k/train.jsonl", "local:mt_bench/question.jsonl"}
    looked_at.clear()  # the plan's own composition reads the config package
    assert all(Path(resolve_path(p)).is_relative_to(PACKAGE / "sets") for *_, p in files)
    assert all(p.is_relative_to(PACKAGE) for p in looked_at)


def test_spec_distill_data_still_points_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    monkeypatch.setenv("SPECDISTILL_DATA", str(tmp_path))
    assert local_data_dir() == tmp_path
    assert resolve_path("local:gsm8k/test.jsonl") == str(tmp_path / "gsm8k" / "test.jsonl")
    monkeypatch.setenv("SPECDISTILL_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="SPECDISTILL_DATA=.*is not a folder"):
        local_data_dir()
