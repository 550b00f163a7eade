"""The draft-length policies through the validate stage and `decode.bench compare_draft`, on the
toy-tiny pair (p = target, q = drafter): reports carry the draft-length figures, greedy stays
token-identical, and bad settings are one `error:` line naming the field."""

from __future__ import annotations

import json
import logging

import pytest

from specdistill.data.runtime import ConfigError
from tests.decode.test_errors_and_cli import _cli


def _cfg(tmp_path, *extra: str):
    from hydra import compose, initialize_config_module

    overrides = ["pair=toy-tiny", f"output_dir={tmp_path}", "num_prompts=2", "max_new_tokens=12"]
    overrides += ["repeats=1", "hf_assisted=false", "step_time_iters=2", "plot=false", *extra]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="validate", overrides=overrides)


def test_validate_reports_the_policy_beside_fixed_gamma(tmp_path, toy_tiny, caplog, capsys):
    from specdistill.decode.validate.stage import run

    caplog.set_level(logging.INFO, logger="specdistill.decode.validate.stage")
    r = run(_cfg(tmp_path, "decoder.draft_length=confidence", "decoder.max_draft=6"))
    # each phase says what it runs; each timed pass has its bar (progress: true), on stderr
    assert "validate: untimed warm-up, then the timed repeats (1)" in caplog.text
    err = capsys.readouterr().err
    for label in ("validate greedy", "validate sampling", "validate fixed gamma 4"):
        assert f"{label}: 100%" in err
    assert r.lossless is True and r.draft_length == "confidence"
    f = r.draft_figures
    assert f is not None and f["max_draft"] == 6 and len(f["draft_lengths"]) == 7
    assert sum(f["draft_lengths"]) > 0 and set(f["draft_costs"]) == {
        "c",
        "verify_per_token",
        "round_overhead",
        "glue_per_draft",  # timed in the decoder's own rounds (draft_length.measure.round_glue)
        "verify_tokens",  # decoder.verify_costs=by_width: one entry per verify width
        "prefill_per_token",  # the drafter's lazy prefill: per prompt token and per call
        "prefill_fixed",
    }
    assert len(f["draft_costs"]["verify_tokens"]) == 6
    assert r.fixed_gamma_speedup is not None and r.fixed_gamma_speedup > 0
    md = (tmp_path / "report.md").read_text()
    assert "draft length policy | confidence" in md and "fixed gamma=4 beside it" in md


def test_validate_times_the_pairs_forwards_once_over_its_decoders(tmp_path, toy_tiny, monkeypatch):
    """gamma=auto's pilot, the serving mode's and the other mode's decoders share one timing of
    the forwards (decode/draft_length/costs_memo.py); each serving mode times its own glue."""
    from specdistill.decode.draft_length import measure
    from specdistill.decode.validate.stage import run

    calls = {"forwards": 0, "glue": []}
    forwards, glue = measure.time_forwards, measure.round_glue

    def count_forwards(*a, **k):
        calls["forwards"] += 1
        return forwards(*a, **k)

    def count_glue(dec, *a, **k):
        calls["glue"].append(dec.cfg.sampling.temperature)
        return glue(dec, *a, **k)

    monkeypatch.setattr(measure, "time_forwards", count_forwards)
    monkeypatch.setattr(measure, "round_glue", count_glue)
    r = run(
        _cfg(
            tmp_path, "decoder.gamma=auto", "decoder.max_draft=3", "decoder.draft_length=confidence"
        )
    )
    assert r.draft_length == "confidence" and set(r.modes) == {"greedy", "sampling"}
    assert calls == {"forwards": 1, "glue": [0.0, 1.0]}


def test_bench_compare_draft_side_by_side(tmp_path, toy_tiny, capsys):
    from specdistill.decode.bench.draft import run_draft

    # the first adaptive entry prices widths on a line: the shared costs still time each width
    report = run_draft(_cfg(tmp_path, "compare_draft=[1,auto,heuristic-linear,confidence-row]"))
    assert set(report["modes"]) == {"greedy", "sampling"}
    for name, mode in report["modes"].items():
        rows = {r["entry"]: r for r in mode["rows"]}
        assert list(rows) == ["gamma=1", "gamma=auto", "heuristic-linear", "confidence-row"]
        for r in rows.values():
            assert r["speedup"] > 0 and sum(r["draft_lengths"]) > 0
            assert r["lossless"] is (True if name == "greedy" else None)
        assert rows["gamma=1"]["mean_draft_length"] <= 1.0
    saved = json.loads((tmp_path / "draft.json").read_text())
    assert saved["entries"] == report["entries"]
    assert "| confidence-row |" in (tmp_path / "draft.md").read_text()
    # one cost measurement for the adaptive entries, every verify width timed (max_draft 8)
    assert len(saved["modes"]["greedy"]["draft_costs"]["verify_tokens"]) == 8
    assert "costs (target steps): c " in (tmp_path / "draft.md").read_text()
    # a bar per serving mode over its timed repeats, finished (stderr)
    err = capsys.readouterr().err
    assert "bench greedy: 100%" in err and "bench sampling: 100%" in err


def test_bad_compare_draft_entry_names_the_field(tmp_path):
    from specdistill.decode.bench.draft import parse_entries

    with pytest.raises(ConfigError, match=r"^compare_draft entry 'fast'"):
        parse_entries(["fast"])
    with pytest.raises(ConfigError, match=r"^compare_draft entry 'confidence-rows'"):
        parse_entries(["confidence-rows"])
    assert parse_entries([2, "confidence-row-nofloor"])[1][1] == {
        "draft_length": "confidence",
        "draft_scope": "row",
        "draft_floor": False,
    }
    entries = parse_entries(["1-lookup", "confidence-lookup"])
    assert entries[0] == ("gamma=1-lookup", {"draft_length": "fixed", "gamma": 1, "lookup": True})
    assert entries[1][1] == {"draft_length": "confidence", "lookup": True}
    with pytest.raises(ConfigError, match=r"^compare_draft entry '2-nofloor'"):
        parse_entries(["2-nofloor"])
    assert parse_entries(["confidence-linear"])[0][1] == {
        "draft_length": "confidence",
        "verify_costs": "linear",
    }
    with pytest.raises(ConfigError, match=r"^compare_draft entry '2-linear'"):
        parse_entries(["2-linear"])  # a fixed gamma plans nothing with the costs


@pytest.mark.parametrize(
    ("arg", "field"),
    [
        ("decoder.draft_length=auto", "decoder.draft_length"),
        ("decoder.max_draft=0", "decoder.max_draft"),
        ("decoder.draft_scope=rows", "decoder.draft_scope"),
        ("decoder.probe_every=0", "decoder.probe_every"),
        ("decoder.draft_costs=fast", "decoder.draft_costs"),
    ],
)
def test_cli_bad_draft_length_setting_is_one_line(tmp_path, toy_tiny, arg, field):
    r = _cli("pair=toy-tiny", f"output_dir={tmp_path}", arg)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {field}="), r.stderr[-500:]
