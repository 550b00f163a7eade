"""Draft length and K through the validate stage and `decode.bench compare_draft`, on the
toy-tiny pair (p = target, q = drafter): reports carry acceptance by position, the draft-length
figures and the recommended K, greedy stays token-identical, and bad settings are one `error:`
line naming the field."""

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


def test_validate_reports_the_policy_and_its_draft_lengths(tmp_path, toy_tiny, caplog, capsys):
    from specdistill.decode.validate.stage import run

    caplog.set_level(logging.INFO, logger="specdistill.decode.validate.engines.ours")
    r = run(_cfg(tmp_path, "decoder.draft_length=heuristic", "decoder.max_draft=6"))
    # each phase says what it runs; each timed pass has its bar (progress: true), on stderr
    assert "validate: untimed warm-up, then the timed repeats (1)" in caplog.text
    err = capsys.readouterr().err
    for label in ("validate greedy", "validate sampling"):
        assert f"{label}: 100%" in err
    assert r.lossless is True and r.draft_length == "heuristic" and r.max_draft == 6
    assert len(r.draft_lengths) == 7 and sum(r.draft_lengths) > 0
    assert r.mean_draft_length == pytest.approx(
        sum(k * n for k, n in enumerate(r.draft_lengths)) / sum(r.draft_lengths), abs=1e-3
    )
    assert len(r.acceptance_by_position) == 6
    md = (tmp_path / "report.md").read_text()
    assert "draft lengths (heuristic, at most 6)" in md


def test_validate_recommends_k_at_this_machine_and_at_the_users_costs(tmp_path, toy_tiny):
    """The recommended K is the cost model's argmax over acceptance by position up to
    recommend_max_k, measured in one untimed decode at that K, priced at this machine's costs
    and at each cost_model entry's."""
    from specdistill.decode.draft_length import DraftCosts, recommend_k
    from specdistill.decode.validate.stage import run

    users = "cost_model=[{batch:1,c:0.0,verify_per_token:0.0},{batch:8,c:0.5,verify_per_token:0.2}]"
    r = run(_cfg(tmp_path, "recommend_max_k=6", users))
    rec = r.recommended_k
    assert rec["max_k"] == 6 and rec["source"] == "an untimed decode at K=6"
    accept = rec["acceptance_by_position"]
    assert len(accept) == 6 and all(0.0 <= a <= 1.0 for a in accept)
    machine, free, dear = rec["by_cost"]
    assert machine["label"].startswith("this machine (") and machine["c"] == r.c
    for entry in (free, dear):
        costs = DraftCosts(c=entry["c"], verify_per_token=entry["verify_per_token"])
        k, speed = recommend_k(accept, costs)
        assert (entry["k"], entry["speedup"]) == (k, round(speed, 3))
        assert entry["pays"] is (speed > 1.0)
    assert (free["batch"], dear["batch"]) == (1, 8)
    assert free["speedup"] >= dear["speedup"]  # free drafts can only help
    md = (tmp_path / "report.md").read_text()
    assert "recommended K, cost_model (batch 8) (c 0.5, verify +0.2/draft)" in md


def test_validate_reads_the_recommendation_off_its_own_decode_when_k_reaches(tmp_path, toy_tiny):
    from specdistill.decode.validate.stage import run

    r = run(_cfg(tmp_path, "recommend_max_k=3", "both_modes=false"))
    rec = r.recommended_k
    assert rec["source"] == "the serving decode (K=4)"
    assert rec["acceptance_by_position"] == r.acceptance_by_position[:3]
    off = run(_cfg(tmp_path / "off", "recommend_max_k=0", "both_modes=false"))
    assert off.recommended_k is None


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("recommend_max_k=16", "recommend_max_k=16 must be an integer in 0..15"),
        ("cost_model=[{verify_per_token:0.1}]", "cost_model[0]="),
        ("cost_model=[{c:0.1,overhead:1}]", "cost_model[0]: unknown key(s) ['overhead']"),
        ("cost_model=[{c:0.1,batch:0}]", "cost_model[0].batch=0"),
        ("+prefill_once=true", "prefill_once was removed"),
    ],
)
def test_bad_recommendation_settings_name_the_field(arg, message):
    from specdistill.decode.validate.settings import ValidateSettings

    with pytest.raises(ConfigError) as err:
        ValidateSettings.from_cfg(_cfg("/tmp/unused", arg))
    assert str(err.value).startswith(message)


def test_bench_compare_draft_side_by_side(tmp_path, toy_tiny, capsys):
    from specdistill.decode.bench.draft import run_draft

    report = run_draft(_cfg(tmp_path, "compare_draft=[1,4,heuristic,confidence-lookup]"))
    assert set(report["modes"]) == {"greedy", "sampling"}
    for name, mode in report["modes"].items():
        rows = {r["entry"]: r for r in mode["rows"]}
        assert list(rows) == ["K=1", "K=4", "heuristic", "confidence-lookup"]
        for r in rows.values():
            assert r["speedup"] > 0 and sum(r["draft_lengths"]) > 0
            assert r["lossless"] is (True if name == "greedy" else None)
        assert rows["K=1"]["mean_draft_length"] <= 1.0
        assert len(rows["K=4"]["acceptance_by_position"]) == 4
    saved = json.loads((tmp_path / "draft.json").read_text())
    assert saved["entries"] == report["entries"]
    assert "| confidence-lookup |" in (tmp_path / "draft.md").read_text()
    # a bar per serving mode over its timed repeats, finished (stderr)
    err = capsys.readouterr().err
    assert "bench greedy: 100%" in err and "bench sampling: 100%" in err


def test_bad_compare_draft_entry_names_the_field():
    from specdistill.decode.bench.draft import parse_entries

    for bad in ("fast", "auto", "confidence-row", "2-nofloor", "16"):
        with pytest.raises(ConfigError, match=rf"^compare_draft entry '{bad}'"):
            parse_entries([bad])
    entries = parse_entries([2, "1-lookup", "confidence-lookup"])
    assert entries[0] == ("K=2", {"draft_length": "fixed", "gamma": 2})
    assert entries[1] == ("K=1-lookup", {"draft_length": "fixed", "gamma": 1, "lookup": True})
    assert entries[2] == ("confidence-lookup", {"draft_length": "confidence", "lookup": True})


@pytest.mark.parametrize(
    ("arg", "field"),
    [
        ("decoder.draft_length=auto", "decoder.draft_length="),
        ("decoder.max_draft=0", "decoder.max_draft="),
        ("decoder.p_min=2", "decoder.p_min="),
        ("+decoder.draft_scope=rows", "decoder.draft_scope was removed"),
        ("decoder.gamma=auto", "decoder.gamma=auto was removed"),
    ],
)
def test_cli_bad_draft_length_setting_is_one_line(tmp_path, toy_tiny, arg, field):
    r = _cli("pair=toy-tiny", f"output_dir={tmp_path}", arg)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {field}"), r.stderr[-500:]
