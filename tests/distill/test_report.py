"""The pipeline's report: base vs distilled side by side, every figure labelled with its method."""

from __future__ import annotations

import json

from specdistill.distill import report

BASE = {"alpha": 0.37, "alpha_sampled": 0.51, "tau": 1.58, "tau_sampled": 1.4, "speedup": 0.5,
        "theoretical_speedup": 0.9, "lossless": True, "hf_assisted": {"speedup": 0.73},
        "acceptance_by_position": [0.5, 0.4, 0.3, 0.2], "prompts": 8, "max_new_tokens": 48,
        "gamma": 4, "device": "cpu", "dtype": "float32"}  # fmt: skip
DIST = {**BASE, "alpha": 0.89, "alpha_sampled": 0.57, "speedup": 1.06, "lossless": False,
        "hf_assisted": {"speedup": 0.91}, "acceptance_by_position": [0.95, 0.9, 0.88, 0.85]}  # fmt: skip
DISTILL = {"alpha_before": 0.41, "alpha_after": 0.55, "greedy_agreement_before": 0.3,
           "greedy_agreement_after": 0.8, "steps": 150, "loss": {"name": "fkl"},
           "drafter_path": "/r/distill/best"}  # fmt: skip


def test_table_puts_base_and_distilled_side_by_side_with_methods():
    lines = report.comparison_table({"validate_base": BASE, "validate": DIST, "distill": DISTILL})
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert rows["alpha, greedy"] == "| alpha, greedy | decode-time acceptance | 0.37 | 0.89 |"
    assert rows["alpha, temperature 1"].endswith("| 0.51 | 0.57 |")
    assert rows["HF assisted speedup, same pair"].endswith("| 0.73 | 0.91 |")
    assert rows["lossless (output = target's)"].endswith("| yes | no |")
    held = rows["held-out alpha, temperature 1"]
    assert "reference completions" in held and held.endswith("| 0.41 | 0.55 |")
    assert len(rows) == len(report.ROWS)


def test_missing_figures_are_left_out_or_marked():
    lines = report.comparison_table({"validate": {"alpha": 0.8}})
    assert lines[2:] == ["| alpha, greedy | decode-time acceptance | n/a | 0.8 |"]


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
    assert "| alpha, greedy | decode-time acceptance | 0.37 | 0.89 |" in text
    assert "Exported drafter (self-checked): `/r/export/drafter`" in text
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not report.plot_acceptance({"validate": {}}, tmp_path / "none.png")
