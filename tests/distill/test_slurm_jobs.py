"""Per-step Slurm jobs (distill/pipeline/slurm_jobs.py): the pipeline's `slurm` node, per step or
stage over every job's over the cluster settings, reaches the submitit executor; a bad value is
one `error:` line at plan time, before anything is written or submitted."""

from __future__ import annotations

import io
import sys
import types
from typing import Any, ClassVar

import pytest

from specdistill.data.runtime import ConfigError
from specdistill.distill.pipeline import slurm
from specdistill.distill.pipeline.plan import build_plan
from specdistill.distill.pipeline.stage import show_plan, stage_keys_addable
from tests.distill.test_pipeline_slurm import pipeline_cfg, shim_log, slurm_env

PER_STEP = [
    "slurm.time=02:00:00", "slurm.gpus_per_node=8", "slurm.max_num_timeout=5",
    "slurm.distill.nodes=3", "slurm.distill.time=1-00:00:00", "slurm.distill.signal_delay_s=300",
    "slurm.generate.array=4", "slurm.validate.gpus_per_node=1",
    "slurm.validate_base.time=00:30:00", "slurm.export.cpus_per_task=4",
    "slurm.report.partition=cpu",
]  # fmt: skip


class _Executor:
    """submitit.SlurmExecutor's surface the launcher uses, recording what it is given."""

    made: ClassVar[list[_Executor]] = []

    def __init__(self, folder: Any, max_num_timeout: int = 3, python: str | None = None):
        self.init = {"max_num_timeout": max_num_timeout, "python": python}
        self.params: dict[str, Any] = {}
        self.array = 0
        _Executor.made.append(self)

    def update_parameters(self, **params: Any) -> None:
        self.params |= params

    def submit(self, fn: Any, *args: Any) -> Any:
        return types.SimpleNamespace(job_id=str(100 + len(_Executor.made)))

    def map_array(self, fn: Any, *lists: Any) -> list[Any]:
        self.array = len(lists[0])
        return [types.SimpleNamespace(job_id=f"{100 + len(_Executor.made)}_{i}")
                for i in range(self.array)]  # fmt: skip


def _mock_submitit(monkeypatch) -> None:
    _Executor.made = []
    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(SlurmExecutor=_Executor))


def _overrides(*args: str) -> list[str]:
    return stage_keys_addable(list(args))  # as `specdistill` reads its command line


def test_the_executor_receives_each_steps_values(tmp_path, monkeypatch):
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_PARTITION="gpu", SPECDISTILL_ACCOUNT="proj")
    _mock_submitit(monkeypatch)
    ids = slurm.submit(pipeline_cfg(tmp_path / "run", *_overrides(*PER_STEP)), out=io.StringIO())
    assert list(ids) == ["generate", "distill", "validate_base", "validate", "export", "report"]
    ex = dict(zip(ids, _Executor.made, strict=True))
    p = {name: e.params for name, e in ex.items()}
    assert {e.init["max_num_timeout"] for e in ex.values()} == {5}
    assert ex["generate"].array == 4 and p["generate"]["array_parallelism"] == 4
    assert p["generate"]["gpus_per_node"] == 1  # one of the node's 8, the hf backend
    d = p["distill"]
    assert (d["nodes"], d["ntasks_per_node"], d["gpus_per_node"]) == (3, 8, 8)
    assert (d["time"], d["additional_parameters"]["time"]) == (1440, "1-00:00:00")
    assert d["signal_delay_s"] == 300 and d["dependency"] == f"afterok:{ids['generate']}"
    assert (p["validate"]["gpus_per_node"], p["validate"]["time"]) == (1, 120)
    assert p["validate_base"]["additional_parameters"]["time"] == "00:30:00"  # its own section
    assert p["validate_base"]["gpus_per_node"] == 1  # the validate stage's
    assert p["export"]["cpus_per_task"] == 4 and "cpus_per_task" not in p["validate"]
    assert p["report"]["partition"] == "cpu" and p["report"]["gpus_per_node"] is None
    for name in ("generate", "validate", "export"):
        assert p[name]["partition"] == "gpu" and p[name]["signal_delay_s"] == 90
        assert p[name]["account"] == "proj"  # the cluster settings still reach every job


def test_sbatch_lines_carry_the_per_step_values(tmp_path, monkeypatch):
    """Through the real submitit into the recording sbatch shim: the flags Slurm sees."""
    pytest.importorskip("submitit", reason="the `slurm` extra")
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_PARTITION="gpu")
    slurm.submit(pipeline_cfg(tmp_path / "run", *_overrides(*PER_STEP)), out=io.StringIO())
    gen, dist, base, val, exp, rep = (j["sbatch"] for j in shim_log(tmp_path))
    assert (dist["--nodes"], dist["--time"], dist["--signal"]) == ("3", "1-00:00:00", "USR2@300")
    assert (gen["--array"], gen["--time"], gen["--signal"]) == ("0-3%4", "02:00:00", "USR2@90")
    assert (base["--time"], val["--time"], val["--gpus-per-node"]) == ("00:30:00", "02:00:00", "1")
    assert exp["--cpus-per-task"] == "4" and rep["--partition"] == "cpu"


def test_the_pipeline_keys_win_over_the_cluster_settings(tmp_path, monkeypatch):
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_PARTITION="gpu", SPECDISTILL_TIME="01:00:00",
              SPECDISTILL_GPUS_PER_NODE="4", SPECDISTILL_NODES="2")  # fmt: skip
    cfg = pipeline_cfg(tmp_path / "run", *_overrides("slurm.distill.time=10:00:00"))
    jobs = slurm.resources(build_plan(cfg), cfg)
    assert (jobs["distill"].time, jobs["distill"].nodes, jobs["distill"].gpus_per_node) == (
        "10:00:00", 2, 4)  # fmt: skip
    assert jobs["validate"].time == "01:00:00" and jobs["validate"].gpus_per_node == 1


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["slurm.distill.nodes=0"], r"^slurm.distill.nodes=0 must be an integer >= 1$"),
        (["slurm.time=soon"], r"^slurm.time='soon': use HH:MM:SS"),
        (["slurm.validate.nodes=2"], r"^slurm.validate.nodes: only distill steps have nodes"),
        (["slurm.distil.time=01:00:00"], r"^slurm.distil: no step or stage of this plan"),
        (["slurm.distill.tme=01:00:00"], r"^slurm.distill.tme: not a job key"),
        (["++slurm.nodes=2"], r"^slurm.nodes: set it in the distill section"),
        (["slurm.max_num_timeout=-1"], r"^slurm.max_num_timeout=-1 must be an integer >= 0$"),
        (
            ["slurm.distill.signal_delay_s=7200"],
            r"^slurm.distill.signal_delay_s=7200: the "
            r"distill job's signal would come before",
        ),
        (["slurm.validate.time=1"], r"^slurm.signal_delay_s=90: the validate_base job's signal"),
        (["slurm.distill.time=43200"], r"^slurm.distill.time=43200: more than 10080 minutes"),
        (
            ["slurm.gpus_per_node=null"],
            r"^SPECDISTILL_GPUS_PER_NODE is not set: .* or set "
            r"slurm.gpus_per_node",
        ),
    ],
)
def test_a_bad_value_is_one_error_line_at_plan_time(tmp_path, monkeypatch, overrides, match):
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_PARTITION="gpu")
    base = ["slurm.time=01:00:00", "slurm.gpus_per_node=8", "plan=true"]
    cfg = pipeline_cfg(tmp_path / "run", *_overrides(*base, *overrides))
    with pytest.raises(ConfigError, match=match) as e:
        show_plan(cfg)
    assert "\n" not in str(e.value)
    _mock_submitit(monkeypatch)
    with pytest.raises(ConfigError, match=match):  # the same line before any submission
        slurm.submit(cfg, out=io.StringIO())
    assert _Executor.made == [] and not (tmp_path / "run").exists()


def test_the_requeue_defaults_are_the_ones_pipeline_yaml_lists():
    from importlib.resources import files

    from omegaconf import OmegaConf

    from specdistill.distill.pipeline.slurm_jobs import Requeue

    listed = OmegaConf.load(str(files("specdistill.conf").joinpath("pipeline.yaml"))).slurm
    assert Requeue() == Requeue(listed.max_num_timeout, listed.signal_delay_s)
