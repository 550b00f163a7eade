"""`threads`: the CPU thread count a stage sets (data.runtime.set_threads) is checked, and a
pipeline stage does not leave it set for the next one (it changes speed only: decoded tokens
and acceptance figures are the same at any count, tests/decode/test_determinism.py)."""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError, kept_threads, set_threads

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_threads():
    with kept_threads():
        yield


def test_thread_settings_are_checked_and_named():
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigError, match=r"^threads="):
            set_threads(bad, CPU)
    set_threads("auto", CPU)
    assert torch.get_num_threads() == 1
    set_threads(2, torch.device("meta"))  # not a CPU: torch's threads are not ours
    assert torch.get_num_threads() == 1


def test_a_pipeline_stage_does_not_leave_its_threads(tmp_path, monkeypatch):
    from specdistill.distill.pipeline import execute
    from specdistill.distill.pipeline.plan import Step

    def run(cfg):
        set_threads(1, CPU)  # what validate's threads=auto does
        (tmp_path / cfg.name).mkdir()
        (tmp_path / cfg.name / "result.json").write_text("{}")

    monkeypatch.setattr(execute, "_stage_runner", lambda name: run)
    set_threads(2, CPU)
    execute.run_step(Step("validate", "validate", "m", str(tmp_path / "validate"), "result.json",
                          config={"name": "validate"}))  # fmt: skip
    assert torch.get_num_threads() == 2
