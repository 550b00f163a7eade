"""The per-rank memory benchmark (distill/bench/ranks.py): its world builds, both loss paths
run under a 2-process DDP step, and they train on the same loss."""

from __future__ import annotations

import json
import shutil

import pytest

from specdistill.distill.bench import ranks


def test_rel_diff_is_the_largest_relative_gap():
    assert ranks.rel_diff([1.0, 2.0], [1.0, 2.2]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        ranks.rel_diff([1.0], [1.0, 2.0])


@pytest.mark.slow  # two 2-process torchrun launches on CPU
def test_both_paths_run_under_ddp_with_the_same_loss(tmp_path, capsys):
    if shutil.which("torchrun") is None:
        pytest.fail("the `torchrun` CLI is not installed in this environment")
    out = tmp_path / "rows.json"
    ranks.main(["--vocab", "40000", "--strategies", "ddp", "--steps", "1", "--rows", "16",
                "--prompt-len", "32", "--completion-len", "48", "--output", str(out)])  # fmt: skip
    full, masked = json.loads(out.read_text())
    assert (full["path"], masked["path"]) == ("full", "masked+chunked")
    assert masked["loss_rel_diff_to_full"] < 1e-5
    assert masked["peak_rss_mb_per_rank"] < full["peak_rss_mb_per_rank"]
    assert "| ddp | masked+chunked |" in capsys.readouterr().out
