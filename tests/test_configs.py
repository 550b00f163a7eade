"""Every primary config and every experiment composes and resolves (a broken config fails CI)."""

from __future__ import annotations

from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

CONF = files("specdistill.conf")
PRIMARY = sorted(p.name[:-5] for p in CONF.iterdir() if p.name.endswith(".yaml"))
EXPERIMENTS = sorted(
    p.name[:-5] for p in (CONF / "experiment").iterdir() if p.name.endswith(".yaml")
)


def _compose(name: str, overrides: list[str]):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
    OmegaConf.resolve(cfg)
    return cfg


def test_there_are_primary_configs():
    assert {"generate", "pipeline"} <= set(PRIMARY)


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_config_composes(name):
    cfg = _compose(name, [])
    assert "pair" in cfg


def _stage_of(experiment: str) -> str:
    """An experiment names the primary config it extends in a `# stage: NAME` header line."""
    for line in (CONF / "experiment" / f"{experiment}.yaml").read_text().splitlines():
        if line.startswith("# stage:"):
            return line.split(":", 1)[1].strip()
    return "pipeline"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes(name):
    stage = _stage_of(name)
    assert stage in PRIMARY, f"experiment/{name}.yaml names an unknown stage {stage!r}"
    cfg = _compose(stage, [f"+experiment={name}"])
    assert cfg.pair is not None


@pytest.mark.parametrize("pair", ["toy", "toy-tiny", "llama3", "qwen2.5", "smollm2"])
def test_pairs_compose(pair):
    cfg = _compose("generate", [f"pair={pair}"])
    assert ("toy" in pair) == bool(cfg.pair.toy)
    assert (pair == "smollm2") == bool(cfg.pair.real) == bool(cfg.pair.drafter_layers)
