"""`decode.bench compare_modes`: one run measures each decoder step mode, interleaved."""

from __future__ import annotations

import json

import pytest

from specdistill.data.runtime import ConfigError


def _cfg(tmp_path, modes: str):
    from hydra import compose, initialize_config_module

    overrides = ["pair=toy-tiny", f"output_dir={tmp_path}", "num_prompts=2", "max_new_tokens=8"]
    overrides += ["repeats=1", "hf_assisted=false", "step_time_iters=2", "sampled_alpha=false"]
    overrides += [f"compare_modes={modes}", "plot=false"]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="validate", overrides=overrides)


def test_modes_side_by_side(tmp_path, toy_tiny):
    from specdistill.decode.acceptance import expected_tau
    from specdistill.decode.bench.modes import run_modes

    rows = run_modes(_cfg(tmp_path, "[eager,static,compiled-drafter]"))
    assert [(r["mode"], r["cache"], r["compiled"]) for r in rows] == [
        ("eager", "dynamic", False),
        ("static", "static", False),
        ("compiled-drafter", "dynamic", "drafter"),
    ]
    assert all(r["lossless"] is True for r in rows)
    assert len({r["alpha"] for r in rows}) == 1  # only speed differs
    for r in rows:  # the formula with the measured verify cost, from the row's own figures
        tau = expected_tau(r["alpha"], 4) / (4 * r["c"] + r["verify_cost"])
        assert r["theoretical_speedup_measured_verify"] == pytest.approx(tau, abs=0.01)
    saved = json.loads((tmp_path / "modes.json").read_text())
    assert saved["modes"] == rows
    table = (tmp_path / "modes.md").read_text()
    assert (
        "| figure | eager | static | compiled-drafter |" in table and "decoder_efficiency" in table
    )
    assert all(r["warmup_seconds"] >= 0 and r["c"] > 0 for r in rows)


def test_unknown_mode_names_the_field(tmp_path):
    from specdistill.decode.bench.modes import run_modes

    with pytest.raises(ConfigError, match=r"compare_modes=\['eager', 'fast'\]"):
        run_modes(_cfg(tmp_path, "[eager,fast]"))
