"""The pipeline's report: base vs distilled side by side, every figure labelled with its method."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from specdistill.distill.pipeline import report

BASE = {"alpha": 0.37, "alpha_sampled": 0.51, "tau": 1.58, "tau_sampled": 1.4, "speedup": 0.5,
        "theoretical_speedup": 0.9, "lossless": True, "hf_assisted": {"speedup": 0.73},
        "acceptance_by_position": [0.5, 0.4, 0.3, 0.2], "prompts": 8, "max_new_tokens": 48,
        "gamma": 4, "device": "cpu", "dtype": "float32"}  # fmt: skip
DIST = {**BASE, "alpha": 0.89, "alpha_sampled": 0.57, "speedup": 1.06, "lossless": False,
        "hf_assisted": {"speedup": 0.91}, "acceptance_by_position": [0.95, 0.9, 0.88, 0.85]}  # fmt: skip
DISTILL = {"alpha_before": 0.41, "alpha_after": 0.55, "greedy_agreement_before": 0.3,
           "greedy_agreement_after": 0.8, "steps": 150, "loss": {"name": "fkl"},
           "drafter_path": "/r/distill/best"}  # fmt: skip


def _rows(stages):
    return {line.split(" | ")[0].lstrip("| "): line for line in report.comparison_table(stages)[2:]}


def test_table_puts_base_and_distilled_side_by_side_with_methods():
    """Reports from before `modes` (greedy top level, temperature-1 `*_sampled`) still read."""
    rows = _rows({"validate_base": BASE, "validate": DIST, "distill": DISTILL})
    assert (
        rows["alpha, greedy"]
        == "| alpha, greedy | decode-time acceptance, every draft (prompt lookup's too) | 0.37 | 0.89 |"
    )
    assert rows["alpha, temperature 1"].endswith("| 0.51 | 0.57 |")
    assert rows["HF assisted speedup, same pair"].endswith("| 0.73 | 0.91 |")
    assert rows["lossless (output = target's)"].endswith("| yes | no |")
    held = rows["held-out alpha, temperature 1"]
    assert "reference completions" in held and held.endswith("| 0.41 | 0.55 |")
    assert rows["tau at K=4 (tokens per round, bonus included), greedy"].endswith("| 1.58 | 1.58 |")
    assert rows["acceptance by draft position, greedy"].endswith(
        "| 0.50 0.40 0.30 0.20 | 0.95 0.90 0.88 0.85 |"
    )
    # no sampled speedup or acceptance by position was kept then, nor prompt lookup, nor the
    # drafter's own alpha, nor tokens per second by mode, nor a recommended K: those rows are
    # left out
    assert len(rows) == len(report.ROWS) - 7


def _modes(greedy, sampled):
    return {
        "greedy": {"temperature": 0.0, "top_p": 1.0, **greedy},
        "sampling": {"temperature": 0.7, "top_p": 0.9, **sampled},
    }


def test_speedup_rows_show_the_repeats_range_beside_the_median():
    """A measured speedup near 1.0 is read with its per-repeat spread; a range of one value
    (one repeat) or none (older reports) leaves the median alone."""
    dist = {
        **DIST,
        "modes": _modes(
            {"alpha": 0.9, "tau": 3.0, "speedup": 1.63, "speedup_range": [1.5, 1.71]},
            {"alpha": 0.45, "tau": 1.0, "speedup": 0.973, "speedup_range": [0.941, 1.012]},
        ),
    }
    base = {**BASE, "modes": _modes({"speedup": 1.79, "speedup_range": [1.79, 1.79]}, {})}
    rows = _rows({"validate_base": base, "validate": dist, "distill": DISTILL})
    greedy = rows["speedup over target-only, this machine, greedy"]
    assert greedy.endswith("| 1.79 | 1.63 (1.5-1.71) |")
    assert "median (range) of repeats" in greedy
    sampled = rows["speedup over target-only, this machine, temperature 0.7, top_p 0.9"]
    assert sampled.endswith("| n/a | 0.973 (0.941-1.01) |")
    header = {**dist, "prompts": 8, "max_new_tokens": 48, "repeats": 3}
    text = report.summary_markdown("/r", {"validate": header, "distill": DISTILL}, 1.0)
    assert "8 held-out prompts x 48 new tokens, 3 timed repeats, " in text
    one = report.summary_markdown("/r", {"validate": {**header, "repeats": 1}}, 1.0)
    assert "48 new tokens, 1 timed repeat, " in one


def test_both_serving_modes_with_speedups_and_the_serving_mode_held_out_figure():
    base = {
        **BASE,
        "temperature": 0.7,
        "alpha": 0.5,
        "modes": _modes(
            {
                "alpha": 0.37,
                "drafter_alpha": 0.02,
                "tau": 1.6,
                "speedup": 0.5,
                "acceptance_by_position": [0.3, 0.2],
            },
            {
                "alpha": 0.5,
                "drafter_alpha": 0.4,
                "tau": 1.9,
                "speedup": 0.7,
                "acceptance_by_position": [0.5, 0.45],
            },
        ),
    }
    dist = {
        **DIST,
        "temperature": 0.7,
        "alpha": 0.73,
        "modes": _modes(
            {
                "alpha": 0.11,
                "drafter_alpha": 0.6,
                "tau": 1.1,
                "speedup": 0.4,
                "baseline_tokens_per_s": {"median": 20.0},
                "speculative_tokens_per_s": {"median": 8.0},
            },
            {
                "alpha": 0.73,
                "drafter_alpha": 0.7,
                "tau": 3.1,
                "speedup": 1.2,
                "acceptance_by_position": [0.8, 0.75],
            },
        ),
        "lookup": {"round_share": 0.4, "acceptance": 0.93},
        "recommended_k": {"by_cost": [{"k": 3, "speedup": 1.41, "c": 0.2}]},
    }
    distill = {**DISTILL, "data": {"eval_source": "target",
               "eval_sampling": {"temperature": 0.7, "top_k": 0, "top_p": 0.9}}}  # fmt: skip
    rows = _rows({"validate_base": base, "validate": dist, "distill": distill})
    assert rows["alpha, greedy"].endswith("| 0.37 | 0.11 |")
    assert rows["alpha, temperature 0.7, top_p 0.9"].endswith("| 0.5 | 0.73 |")
    assert rows["the drafter's own alpha, greedy"] == (
        "| the drafter's own alpha, greedy | decode-time acceptance, the drafter's drafts only "
        "| 0.02 | 0.6 |"
    )
    assert rows["the drafter's own alpha, temperature 0.7, top_p 0.9"].endswith("| 0.4 | 0.7 |")
    assert rows["speedup over target-only, this machine, greedy"].endswith("| 0.5 | 0.4 |")
    assert rows["speedup over target-only, this machine, temperature 0.7, top_p 0.9"].endswith(
        "| 0.7 | 1.2 |"
    )
    assert rows["rounds drafted by prompt lookup, serving mode"].endswith("| n/a | 0.40 (0.93) |")
    assert rows["recommended K (modeled speedup), serving mode"].endswith(
        "| n/a | 3 (1.41x at c 0.2) |"
    )
    assert rows["acceptance by draft position, temperature 0.7, top_p 0.9"].endswith(
        "| 0.50 0.45 | 0.80 0.75 |"
    )
    assert rows["tokens per second, greedy: target-only / speculative"].endswith("| n/a | 20 / 8 |")
    held = rows["held-out alpha, temperature 0.7, top_p 0.9"]
    assert "sum min(p,q) on the target's sampled continuations" in held
    assert len(rows) == len(report.ROWS)
    served = {"mode": "sampling", "sampling": {"temperature": 0.7, "top_p": 0.9}}
    recipe = {"name": "sampling", "loss": "tvd"}
    stages = {"validate": dist, "distill": distill}
    text = report.summary_markdown("/r", stages, 1.0, served, recipe)
    assert "Served sampling at temperature 0.7, top_p 0.9; recipe `sampling`" in text
    # pipeline.json of runs before the one sampling spec held the keys flat
    old = {"mode": "sampling", "temperature": 0.7, "top_p": 0.9}
    assert report.summary_markdown("/r", stages, 1.0, old, recipe) == text


def test_a_drafter_that_drafted_nothing_reads_na_not_zero():
    """Every tested draft prompt lookup's: the drafter's own 0.0 is no measurement, and the
    summary and report.md say so; positions it never drafted at read '-'."""
    from specdistill.decode.validate.report import ValidateResult, report_markdown

    none = {"alpha": 0.53, "drafter_alpha": 0.0, "drafter_trials": 0, "tau": 1.6}
    some = {"alpha": 0.54, "drafter_alpha": 0.47, "drafter_trials": 19, "tau": 1.7}
    base = {**BASE, "modes": _modes(none, {**none, "drafter_alpha": 0.01, "drafter_trials": 70})}
    dist = {**DIST, "modes": _modes(some, some)}
    rows = _rows({"validate_base": base, "validate": dist, "distill": DISTILL})
    assert rows["the drafter's own alpha, greedy"].endswith("| n/a (0 drafts of its own) | 0.47 |")
    assert rows["the drafter's own alpha, temperature 0.7, top_p 0.9"].endswith("| 0.01 | 0.47 |")
    rate = {"median": 10.0, "min": 9.0, "max": 11.0}
    required = {f.name: 0 for f in dataclasses.fields(ValidateResult)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # fmt: skip
    required |= {"output_dir": "/r", "target": "/t", "drafter": "/d", "device": "cpu",
                 "dtype": "float32", "baseline_tokens_per_s": rate,
                 "speculative_tokens_per_s": rate, "acceptance_by_position": []}  # fmt: skip
    md = report_markdown(ValidateResult(**required, drafter_alpha=0.0, drafter_trials=0))
    assert "| the drafter's own alpha (its drafts only) / by position | n/a (0 drafts" in md
    r = ValidateResult(**required, drafter_alpha=0.5, drafter_trials=4,
                       drafter_acceptance_by_position=[0.75, 0.0, 0.0],
                       drafter_trials_by_position=[4, 3, 0])  # fmt: skip
    assert "| 0.5 (4 drafts) / 0.75 0.00 - |" in report_markdown(r)


def test_missing_figures_are_left_out_or_marked():
    lines = report.comparison_table({"validate": {"alpha": 0.8}})
    assert lines[2:] == [
        "| alpha, greedy | decode-time acceptance, every draft (prompt lookup's too) | n/a | 0.8 |"
    ]


def test_tokens_per_second_stand_beside_the_speedup():
    """The absolute speed of both sides (medians of the repeats): a ratio alone hides what a
    thread count or a machine does to both; a side without rates reads n/a."""

    def rates(base, spec):
        return {"baseline_tokens_per_s": {"median": base, "min": 0.0, "max": 99.0},
                "speculative_tokens_per_s": {"median": spec, "min": 0.0, "max": 99.0}}  # fmt: skip

    dist = {**DIST, "modes": _modes({"speedup": 1.25, **rates(30.12, 37.59)}, {})}
    base = {**BASE, "modes": _modes({"speedup": 1.1}, {})}
    row = _rows({"validate_base": base, "validate": dist})[
        "tokens per second, greedy: target-only / speculative"
    ]
    assert row.endswith("| wall clock: medians of repeats | n/a | 30.1 / 37.6 |")
    fast = {**DIST, "modes": _modes(rates(733.4, 1224.3), {})}
    assert _rows({"validate": fast})[
        "tokens per second, greedy: target-only / speculative"
    ].endswith("| n/a | 733 / 1224 |")


def test_cli_rebuilds_summary_and_plot_from_a_run_folder(tmp_path, capsys):
    for stage, data in (("validate_base", BASE), ("validate", DIST)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "report.json").write_text(json.dumps(data))
    (tmp_path / "export" / "drafter").mkdir(parents=True)
    (tmp_path / "export" / "drafter" / "export.json").write_text(
        json.dumps({"output_dir": "/r/export/drafter", "usage": "generate(assistant_model=...)"})
    )
    report.main([str(tmp_path)])
    text = (tmp_path / "summary.md").read_text()
    assert (
        "| alpha, greedy | decode-time acceptance, every draft (prompt lookup's too) | 0.37 | 0.89 |"
        in text
    )
    assert "Exported drafter (self-checked): `/r/export/drafter`" in text
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not report.plot_acceptance({"validate": {}}, tmp_path / "none.png")


def test_summary_shows_the_exported_drafter_in_vllm():
    """`specdistill vllm=true`: the export's vLLM figures, vLLM beside ours, in summary.md."""
    vllm = {
        "version": "0.32.0",
        "num_speculative_tokens": 4,
        "device": "cpu",
        "report": "/run/export/drafter_vllm/report.json",
        "greedy_identical_to_plain": True,
        "modes": {
            "greedy": {"acceptance_rate": 0.833, "ours_acceptance_rate": 0.809,
                       "mean_acceptance_length": 3.469, "ours_mean_acceptance_length": 3.357,
                       "speedup": 1.189, "ours_speedup": 0.989, "beyond_noise": False},
            "sampling": {"acceptance_rate": 0.003, "ours_acceptance_rate": 0.573,
                         "mean_acceptance_length": 1.003, "ours_mean_acceptance_length": 2.211,
                         "speedup": 0.251, "ours_speedup": 0.81, "beyond_noise": True},
        },
        "notes": ["sampling: vLLM 0.32.0 on this platform cannot sample speculatively"],
    }  # fmt: skip
    export = {"output_dir": "/run/export/drafter", "usage": "generate(...)", "vllm": vllm}
    text = report.summary_markdown("/run", {"export": export}, None)
    assert "| greedy | 0.833 / 0.809 | 3.47 / 3.36 | 1.19x / 0.989x |" in text
    assert "| sampling | 0.003 / 0.573 (beyond noise) |" in text
    assert "cannot sample speculatively" in text
    assert report.summarize({"export": export})["export.vllm"] == vllm
    assert "In vLLM" not in report.summary_markdown(
        "/run", {"export": {**export, "vllm": None}}, None
    )


def test_summary_carries_the_heldout_prediction():
    from specdistill.distill.pipeline.report import prediction_lines

    pred = {
        "exact": True,
        "rows": 32,
        "costs": {"c": 0.39, "source": "measured"},
        "figures": {
            "gamma=4": {"tau": 3.53, "speedup": 1.21},
            "heuristic": {"tau": 3.76, "speedup": 1.33},
        },
    }
    text = "\n".join(prediction_lines(pred))
    assert "exact replay, 32 rows" in text and "c 0.39" in text
    assert "gamma=4 1.21x (tau 3.53)" in text and "heuristic 1.33x (tau 3.76)" in text
    assert prediction_lines(None) == []


def test_an_uncalibrated_prediction_is_priced_with_validates_measured_costs():
    """The distill stage without configured costs prices rounds with the default cost model;
    the summary re-prices the same outcomes with the c and verify cost validate measured (and
    says so), and the cost model it builds reproduces the measured verify exactly."""
    from specdistill.decode.draft_length import costs_from_steps
    from specdistill.distill.pipeline.report import prediction_lines
    from specdistill.distill.train.predict import (
        UNCALIBRATED,
        pack_outcomes,
        predict,
        reprice,
        unpack_outcomes,
    )

    rows = [([True, True, False, True, True, True], [0.9, 0.8, 0.3, 0.95, 0.9, 0.7])] * 3
    assert unpack_outcomes(pack_outcomes(rows)) == rows
    knobs = {"gamma": 4, "max_draft": 8, "p_min": 0.75}
    default = predict(rows, **knobs, costs=costs_from_steps(0.4, 1.2, 4))
    pred = {"exact": True, "rows": 3, **knobs, "figures": default,
            "costs": {"c": 0.4, "source": UNCALIBRATED}, "outcomes": pack_outcomes(rows)}  # fmt: skip
    validate = {"c": 0.175, "verify_cost": 1.54, "gamma": 4}
    got = reprice(pred, validate)
    costs = costs_from_steps(0.175, 1.54, 4)
    assert abs(costs.round_cost(4) - (4 * 0.175 + 1.54)) < 1e-12
    assert got["figures"] == predict(rows, **knobs, costs=costs)
    assert got["figures"]["gamma=4"]["speedup"] > default["gamma=4"]["speedup"]
    # tau, draft lengths and acceptance do not read costs: only the speedups move
    for name, f in got["figures"].items():
        assert {k: v for k, v in f.items() if k != "speedup"} == {
            k: v for k, v in default[name].items() if k != "speedup"
        }
    line = "\n".join(prediction_lines(got))
    assert "measured by validate (c 0.175, a 5-token verify 1.54 target steps)" in line
    # nothing measured, or a prediction priced with configured costs: left as it was
    assert reprice(pred, {}) is pred
    configured = {k: v for k, v in pred.items() if k != "outcomes"}
    assert reprice(configured, validate) is configured
    assert "uncalibrated" in "\n".join(prediction_lines(pred))
    # a prediction written before p_min was recorded replays at the decoder's default
    old = {k: v for k, v in pred.items() if k != "p_min"}
    assert reprice(old, validate)["figures"] == got["figures"]


@pytest.mark.parametrize("verify_cost", [0.678, 0.95, 1.0, 1.54])
@pytest.mark.parametrize("gamma", [1, 4])
def test_validates_costs_never_price_a_draft_below_nothing(verify_cost, gamma):
    """The cost model built from validate's c and (gamma+1)-token verify reproduces that verify
    where it costs at least one target step, and prices one that cost less (a CPU whose 2-row
    GEMM beats its 1-row GEMV) as one: no verify gets cheaper as drafts are added, no round is
    priced under its drafting plus one target step, and a replayed speedup stays under what
    its tau would give at that price (a negative per-draft slope once printed 7.6e11x)."""
    from specdistill.decode.draft_length import costs_from_steps
    from specdistill.distill.train.predict import predict

    c = 0.1728
    costs = costs_from_steps(c, verify_cost, gamma)
    assert abs(costs.round_cost(gamma) - (gamma * c + max(verify_cost, 1.0))) < 1e-12
    verify = [costs.round_cost(k) - k * c for k in range(1, 16)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(verify))
    for k in range(1, 16):
        assert costs.round_cost(k) >= k * c + 1.0 - 1e-12
    rows = [([True] * 40 + [False], [0.99] * 41)] * 2  # long accepted runs: long rounds
    for name, f in predict(rows, gamma=4, max_draft=8, p_min=0.75, costs=costs).items():
        # a round of k drafts emits at most k + 1 tokens and costs at least k c + 1
        assert f["speedup"] <= max((k + 1) / (k * c + 1.0) for k in range(1, 9)) + 1e-9, name


def _bucket(name, alpha, speedup, c=0.2):
    return {
        "bucket": name, "prompts": 2, "mean_prompt_tokens": 300.5, "c": c, "verify_cost": 1.5,
        "kv_cache": {"tokens": 400, "target_bytes": 3 * 2**20, "drafter_bytes": 2**19},
        "modes": {"greedy": {"alpha": alpha, "tau": 2.0, "speedup": speedup},
                  "sampling": {"alpha": alpha / 2, "tau": 1.5, "speedup": 0.9}},
    }  # fmt: skip


def test_per_bucket_table_when_the_validate_reports_have_buckets():
    assert report.bucket_table({"validate_base": BASE, "validate": DIST}) == []
    base = {**BASE, "buckets": [_bucket("0-512", 0.4, 1.1), _bucket("4k-8k", 0.3, 1.0)]}
    dist = {**DIST, "buckets": [_bucket("0-512", 0.7, 1.4, c=0.25), _bucket("4k-8k", 0.6, 1.5)]}
    lines = report.bucket_table({"validate_base": base, "validate": dist})
    rows = [line for line in lines if line.startswith("| 0-512") or line.startswith("| 4k-8k")]
    # tau first (greedy, sampled), then alpha (greedy, sampled), then this machine's speedups
    assert rows[0] == (
        "| 0-512 | 2 (300.5) | 2 / 2 | 1.5 / 1.5 | 0.4 / 0.7 | 0.2 / 0.35 | 1.1 / 1.4 | "
        "0.9 / 0.9 | 0.25 / 1.5 | 3.0 / 0.5 |"
    )
    assert rows[1].startswith("| 4k-8k | 2 (300.5) | 2 / 2 | 1.5 / 1.5 | 0.3 / 0.6 |")
    text = report.summary_markdown("RUN", {"validate_base": base, "validate": dist}, None)
    assert "By context-length bucket" in text and rows[1] in text


def test_bucket_speedups_show_their_range_of_repeats():
    """A bucket's end-to-end speedup carries its per-repeat range (rows without a range print
    the median alone), in the greedy and sampling cells."""
    ranged = _bucket("4k-8k", 0.6, 1.5)
    ranged["modes"]["greedy"]["speedup_range"] = [1.42, 1.61]
    ranged["modes"]["sampling"]["speedup_range"] = [0.9, 0.9]  # repeats agree: median alone
    base = {**BASE, "buckets": [_bucket("4k-8k", 0.3, 1.0)]}
    lines = report.bucket_table({"validate_base": base, "validate": {**DIST, "buckets": [ranged]}})
    row = next(line for line in lines if line.startswith("| 4k-8k"))
    assert "| 1 / 1.5 (1.42-1.61) | 0.9 / 0.9 |" in row
    assert "median (range) of repeats" in "\n".join(lines)


def test_bucket_table_shows_the_drafters_own_alpha_with_its_tested_drafts():
    """Reports that count the drafter's own drafts get its column: alpha (drafts tested), and
    `n/a (0)` where every tested draft was prompt lookup's; a side from before the figure
    reads n/a, and a table of such reports only has no column for it (asserted above)."""

    def own(bucket, alpha, trials):
        g = {**bucket["modes"]["greedy"], "drafter_alpha": alpha, "drafter_trials": trials}
        return {**bucket, "modes": {"greedy": g}}

    sides = {
        "validate_long_base": {"buckets": [own(_bucket("4k-8k", 0.6, 1.0), 0.0, 0)]},
        "validate_long_short": {"buckets": [_greedy_only(_bucket("4k-8k", 0.5, 1.1))]},
        "validate_long": {"buckets": [own(_bucket("4k-8k", 0.6, 1.2), 0.5312, 64)]},
    }
    lines = report.bucket_table(sides, report.LONG_SIDES)
    assert "| tau, greedy | the drafter's own alpha, greedy (drafts tested) | alpha" in lines[3]
    row = next(line for line in lines if line.startswith("| 4k-8k"))
    assert "| 2 / 2 / 2 | n/a (0) / n/a / 0.531 (64) | 0.6 / 0.5 / 0.6 |" in row


def _greedy_only(bucket):
    return {**bucket, "modes": {"greedy": bucket["modes"]["greedy"]}}


def test_long_context_table_sets_three_drafters_side_by_side_in_the_mode_they_ran():
    """`long_context.enabled`: base / short-trained / long-trained drafter per bucket; the leg
    decodes the serving mode only, so only that mode's columns appear; c and KV are
    the long-trained pair's; a bucket one side lacks reads n/a there."""
    sides = {
        "validate_long_base": {"buckets": [_greedy_only(_bucket("4k-8k", 0.05, 0.97))]},
        "validate_long_short": {"buckets": [_greedy_only(_bucket("4k-8k", 0.45, 1.1))]},
        "validate_long": {"buckets": [_greedy_only(_bucket("0-512", 0.55, 1.2)),
                                      _greedy_only(_bucket("4k-8k", 0.58, 1.25, c=0.18))]},
    }  # fmt: skip
    lines = report.bucket_table(sides, report.LONG_SIDES)
    assert lines[3] == (
        "| bucket | prompts (mean tokens) | tau, greedy | alpha, greedy | "
        "speedup, greedy, this machine | c / verify cost | KV MiB, target / drafter |"
    )
    assert "base / short-trained / long-trained drafter" in lines[1]
    rows = {
        line.split(" | ")[0]: line
        for line in lines
        if line.startswith("| 0") or line.startswith("| 4")
    }
    assert rows["| 4k-8k"] == (
        "| 4k-8k | 2 (300.5) | 2 / 2 / 2 | 0.05 / 0.45 / 0.58 | 0.97 / 1.1 / 1.25 | "
        "0.18 / 1.5 | 3.0 / 0.5 |"
    )
    assert rows["| 0-512"].startswith("| 0-512 | 2 (300.5) | n/a / n/a / 2 | n/a / n/a / 0.55 |")
    assert report.bucket_table(sides) == []  # the short table: no validate / validate_base
    sampled = {"validate_long": {"buckets": [{**_bucket("4k-8k", 0.6, 1.2), "modes": {
        "sampling": _bucket("4k-8k", 0.6, 1.2)["modes"]["sampling"]}}]}}  # fmt: skip
    heads = report.bucket_table(sampled, report.LONG_SIDES)[3]
    assert (
        "| tau, temperature 1 | alpha, temperature 1 | speedup, temperature 1, this machine |"
        in heads
    )
    assert "greedy" not in heads
    distill_long = {"steps": 24, "wall_seconds": 812.5, "final_path": "/r/distill_long/final",
                    "alpha_before": 0.6, "alpha_after": 0.58}  # fmt: skip
    stages = {**sides, "distill_long": distill_long,
              "generate_long": {"samples": 36, "wall_seconds": 600.0}}  # fmt: skip
    text = report.summary_markdown("RUN", stages, 10.0)
    assert "## Long contexts (`long_context`)" in text and rows["| 4k-8k"] in text
    assert (
        "fine-tuned on 36 Seq-KD rows after long prompts (generated in 600 s): 24 steps, "
        "812 s; the long-trained drafter is `/r/distill_long/final` "
        "(held-out alpha on the short rows 0.6 -> 0.58)"
    ) in text
    assert "## Long contexts" not in report.summary_markdown("RUN", {"validate": DIST}, None)
    # pipeline.json's flat summary reads the long steps' reports as validate / distill ones
    flat = report.summarize({"validate_long": {"alpha": 0.5}, "distill_long": {"steps": 24}})
    assert flat == {"validate_long.alpha": 0.5, "distill_long.steps": 24}


def test_held_out_alpha_is_the_shipped_checkpoints_not_the_last_steps():
    """best/ is picked by held-out alpha: where the best step is not the last, the table shows
    best/'s figure (the run ships best/), not the last evaluation's."""
    distill = {**DISTILL, "best_alpha": 0.61, "best_step": 100}
    held = _rows({"validate_base": BASE, "validate": DIST, "distill": distill})
    assert held["held-out alpha, temperature 1"].endswith("| 0.41 | 0.61 |")


def test_summary_says_how_the_decoder_drafted():
    """A fixed K by its value; an adaptive policy by name and its most drafts a round (the
    header must not call an adaptive decode 'K=4')."""
    fixed = {**DIST, "draft_length": "fixed"}
    text = report.summary_markdown("/r", {"validate": fixed}, None)
    assert "K=4 drafts a round (fixed, as the engines serve), cpu" in text
    adaptive = {**DIST, "draft_length": "heuristic", "max_draft": 6}
    text = report.summary_markdown("/r", {"validate": adaptive}, None)
    assert "draft length `heuristic` (at most 6 drafts a round), cpu" in text
    assert "K=4 drafts" not in text


def test_an_acceptance_over_no_drafts_reads_n_a_not_zero():
    """A mode whose decodes never tested a draft (every round a plain target step) has no
    acceptance: the summary says so instead of printing 0, which would read as all rejected."""
    none = {"alpha": 0.0, "tau": 1.0, "trials_at": [0, 0, 0, 0], "drafter_trials": 0}
    some = {"alpha": 0.5, "tau": 1.1, "trials_at": [4, 1, 0, 0], "drafter_trials": 4}
    dist = {**DIST, "modes": _modes({"alpha": 0.9, "tau": 3.0}, none)}
    base = {**BASE, "modes": _modes({"alpha": 0.8, "tau": 2.0}, some)}
    rows = _rows({"validate_base": base, "validate": dist, "distill": DISTILL})
    assert rows["alpha, temperature 0.7, top_p 0.9"].endswith(f"| 0.5 | {report.NO_DRAFTS} |")
    assert rows["alpha, greedy"].endswith("| 0.8 | 0.9 |")


def _in_mode(thinking: bool, tau: float, alpha: float) -> dict:
    return {
        "config": {"dataset": {"chat_template_kwargs": {"enable_thinking": thinking}}},
        "modes": {
            "greedy": {"tau": tau, "alpha": alpha},
            "sampling": {"tau": tau - 1, "temperature": 1.0},
        },
    }


def test_summary_puts_the_drafter_in_each_chat_mode_side_by_side():
    stages = {
        "validate": _in_mode(True, 3.25, 0.8),
        "validate_direct": _in_mode(False, 2.5, 0.6),
        "validate_base": _in_mode(True, 1.5, 0.2),  # the base drafter: not a chat-mode row
        "validate_gsm8k": _in_mode(True, 3.0, 0.7),  # another set, the served mode: not a row
    }
    text = report.summary_markdown("run", stages, None)
    rows = [line for line in text.splitlines() if line.startswith("| enable_thinking")]
    assert rows == [
        "| enable_thinking: True (served) | validate | 3.25 / 2.25 | 0.80 / - |",
        "| enable_thinking: False | validate_direct | 2.50 / 1.50 | 0.60 / - |",
    ]
    one_mode = {k: v for k, v in stages.items() if k != "validate_direct"}
    assert "chat mode" not in report.summary_markdown("run", one_mode, None)
