"""The recipe sweep: its Hydra multirun composes (locally and for Slurm) and its summary ranks
recipes per serving mode, across prompt sets, and picks a balanced one."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.data.toy.stream import group_prompts
from specdistill.distill.bench import recipe_summary


def _report(path, dataset, greedy, sampling):
    path.mkdir(parents=True)
    modes = {
        "greedy": {"temperature": 0.0, "alpha": greedy, "tau": 1 + 3 * greedy, "speedup": greedy},
        "sampling": {"temperature": 1.0, "alpha": sampling, "tau": 1 + 3 * sampling,
                     "speedup": sampling},
    }  # fmt: skip
    (path / "report.json").write_text(
        json.dumps(
            {"temperature": 0.0, "alpha": greedy, "modes": modes, "config": {"dataset": dataset}}
        )
    )


def test_summary_ranks_per_mode_over_two_prompt_sets_and_picks_the_balanced_recipe(tmp_path):
    toy = {"source": "toy", "split": None}
    tests = {"source": "toy_stream", "group": "stdlib-tests"}
    figures = {  # recipe: (greedy, sampling) on toy; stdlib-tests a bit lower
        "fkl": (0.9, 0.55), "tvd-onpolicy": (0.1, 0.75), "mixed": (0.8, 0.7)}  # fmt: skip
    for name, (g, s) in figures.items():
        _report(tmp_path / name / "validate", toy, g, s)
        _report(tmp_path / name / "validate_stdlib-tests", tests, g - 0.1, s - 0.1)
    text = recipe_summary.write_summary(tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["sets"] == ["stdlib-tests", "toy-test"]
    assert data["picks"] == {"greedy": "fkl", "sampling": "tvd-onpolicy", "balanced": "mixed"}
    # mixed: greedy (0.8/0.9 + 0.7/0.8)/2, sampling (0.7/0.75 + 0.6/0.65)/2
    sc = data["scores"]["mixed"]
    assert sc["greedy"] == pytest.approx((0.8 / 0.9 + 0.7 / 0.8) / 2)
    assert sc["sampling"] == pytest.approx((0.7 / 0.75 + 0.6 / 0.65) / 2)
    assert "| fkl | 0.900 | 3.70 | 0.90x | 0.550 | 2.65 | 0.55x |" in text
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_greedy_and_sampling_reports_side_by_side_make_one_row(tmp_path):
    """Reports without `modes` (one per decoder) merge into one row per prompt set."""
    ds = {"source": "jsonl", "path": "/x/stdlib_tests.jsonl"}
    for mode, t, alpha in (("greedy", 0.0, 0.8), ("sampling", 1.0, 0.6)):
        d = tmp_path / "r1" / f"stdlib-{mode}"
        d.mkdir(parents=True)
        (d / "report.json").write_text(json.dumps(
            {"temperature": t, "alpha": alpha, "tau": 2.0, "speedup": 1.1,
             "alpha_sampled": None, "config": {"dataset": ds}}))  # fmt: skip
    (row,) = recipe_summary.collect(tmp_path)
    assert row["sets"]["stdlib-tests"]["greedy"]["alpha"] == 0.8
    assert row["sets"]["stdlib-tests"]["sampling"] == {
        "alpha": 0.6, "tau": 2.0, "speedup": 1.1, "temperature": 1.0}  # fmt: skip


def test_recipe_sweep_multirun_composes_locally_and_for_slurm(monkeypatch):
    for key, value in {"SPECDISTILL_PARTITION": "gpu", "SPECDISTILL_TIME": "01:00:00",
                       "SPECDISTILL_GPUS_PER_NODE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    extra = []
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401

        extra = ["hydra/launcher=slurm"]
    except ImportError:
        pass
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="pipeline", return_hydra_config=True, overrides=[
            "+experiment=recipe_sweep", "pair=toy-tiny", "recipe.loss=tvd", "recipe.lmbda=1.0",
            *extra])  # fmt: skip
    assert cfg.run_dir == "multirun/recipe_sweep/tvd-lmbda1.0-seqkd_greedy"
    assert cfg.generate_dir == "multirun/recipe_sweep/seqkd-greedy"
    assert list(cfg.validate_sets) == ["stdlib-tests"]
    assert set(cfg.hydra.sweeper.params) == {"recipe.loss", "recipe.lmbda", "recipe.seqkd"}
    if extra:
        assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")


def test_second_prompt_distribution_is_a_dataset_config():
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="validate", overrides=["pair=toy-tiny", "dataset=stdlib-tests"])
    prompts = load_prompts(cfg.dataset, default_split="test")
    rows = group_prompts("stdlib-tests")[::84]  # Lib/test, never in the toy world's corpus
    assert [p.text for p in prompts] == [r["prompt"] for r in rows] and len(prompts) == 17
    assert all(r["module"].startswith("test/") for r in rows)
    with pytest.raises(ConfigError, match="dataset.group"):
        load_prompts({"source": "toy_stream", "group": "nope"})
