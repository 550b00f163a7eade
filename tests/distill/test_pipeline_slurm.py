"""The pipeline on Slurm through submitit, without a cluster.

`sbatch` and `srun` are shims (tests/slurm_shims/) put first on PATH: they record each
submission (command line and `#SBATCH` lines) and run the job locally in the background with the
SLURM_* variables a real allocation sets; "nodes" are local processes, so the multi-node distill
rendezvous runs for real with 2 CPU processes. SHIM_DRY=1 only records.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError, specdistill_home
from specdistill.distill.pipeline import execute, slurm
from specdistill.distill.pipeline import stage as pipeline
from specdistill.distill.pipeline.plan import build_plan, step_file
from tests.conftest import free_port

SHIMS = Path(__file__).resolve().parents[1] / "slurm_shims"
SETTINGS = {
    "SPECDISTILL_PARTITION": "gpu",
    "SPECDISTILL_TIME": "01:00:00",
    "SPECDISTILL_GPUS_PER_NODE": "1",
}
STEPS = ["generate", "distill", "validate_base", "validate", "export", "report"]


def slurm_env(monkeypatch, tmp_path: Path, dry: bool = True, **settings: str) -> None:
    """The shims first on PATH, the given cluster settings and nothing else of the user's."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SPECDISTILL_")) and key != "SPECDISTILL_HOME":
            monkeypatch.delenv(key)
    # the cache stays where it was: HOME moves below, and an unset SPECDISTILL_HOME follows HOME
    monkeypatch.setenv("SPECDISTILL_HOME", str(specdistill_home()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.config/specdistill/slurm.env
    monkeypatch.setenv("PATH", f"{SHIMS}:{os.environ['PATH']}")
    monkeypatch.setenv("SHIM_LOG", str(tmp_path / "shim.log"))
    monkeypatch.setenv("SHIM_STATE", str(tmp_path / "shim"))
    monkeypatch.setenv("SHIM_DRY", "1" if dry else "0")
    for key, value in settings.items():
        monkeypatch.setenv(key, value)


def shim_log(tmp_path: Path) -> list[dict]:
    log = tmp_path / "shim.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def pipeline_cfg(run_dir: Path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="pipeline",
            overrides=["pair=toy-tiny", f"run_dir={run_dir}", "launcher=slurm", *overrides],
        )


def submitted_call(run_dir: Path, job_id: str) -> tuple:
    """The function and arguments a submitted job will run (submitit's pickle)."""
    from submitit.core.utils import DelayedSubmission

    d = DelayedSubmission.load(run_dir / ".submitit" / job_id / f"{job_id}_submitted.pkl")
    return d.function, d.args


def test_chain_afterok_generate_array_and_multi_node_distill(tmp_path, monkeypatch):
    slurm_env(monkeypatch, tmp_path, **{**SETTINGS, "SPECDISTILL_GPUS_PER_NODE": "8",
              "SPECDISTILL_NODES": "4", "SPECDISTILL_GENERATE_TASKS": "8",
              "SPECDISTILL_ACCOUNT": "proj42", "SPECDISTILL_SBATCH_ARGS": "--qos=high",
              "SPECDISTILL_SETUP": "source /opt/venv/bin/activate"})  # fmt: skip
    run = tmp_path / "run"
    out = io.StringIO()
    # a hub pair without a sizing file (pair=llama3's sets FSDP2 and its own jobs): placement
    # from the cluster settings alone
    ids = slurm.submit(pipeline_cfg(run, "pair=qwen2.5", "++distill.deepspeed=zero3"), out=out)
    assert list(ids) == STEPS
    assert out.getvalue().split() == [f"{k}={v}" for k, v in ids.items()]
    gen, dist, base, val, exp, rep = jobs = shim_log(tmp_path)
    assert [j["job_id"] for j in jobs] == list(ids.values())
    for job in jobs:  # the cluster settings reach every job, as #SBATCH lines
        sb = job["sbatch"]
        assert (sb["--partition"], sb["--time"], sb["--account"], sb["--qos"]) == (
            "gpu", "01:00:00", "proj42", "high")  # fmt: skip
        assert sb["--job-name"] == f"specdistill-{STEPS[jobs.index(job)]}"
        script = (tmp_path / "shim" / f"job-{job['job_id']}.sh").read_text()
        assert "source /opt/venv/bin/activate" in script and "srun" in script
    assert gen["sbatch"]["--array"] == "0-7%8" and gen["dependency"] == []
    assert gen["sbatch"]["--gpus-per-node"] == "1"
    assert (dist["sbatch"]["--nodes"], dist["sbatch"]["--ntasks-per-node"]) == ("4", "8")
    assert dist["sbatch"]["--gpus-per-node"] == "8" and dist["dependency"] == [gen["job_id"]]
    # the base drafter waits for generate only: it checks its prompts are none of the Seq-KD rows
    assert base["dependency"] == [gen["job_id"]]
    assert val["dependency"] == [dist["job_id"], gen["job_id"]]  # the drafter; the rows to avoid
    assert exp["dependency"] == [dist["job_id"], val["job_id"]]
    assert rep["dependency"] == [j["job_id"] for j in jobs[:-1]]
    assert "--gpus-per-node" not in rep["sbatch"]
    # Every job runs the same function on its step's file; placement is all that varies.
    from specdistill.distill.pipeline.step import run_job

    fn, args = submitted_call(run, dist["job_id"])
    assert fn is run_job and args == (str(step_file(run, "distill")), None, None, True)
    for task in range(8):
        fn, args = submitted_call(run, f"{gen['job_id']}_{task}")
        assert args == (str(step_file(run, "generate")), task, 8)
    fn, args = submitted_call(run, val["job_id"])
    assert args == (str(step_file(run, "validate")), None, None, False)


def test_settings_file_with_environment_taking_precedence(tmp_path, monkeypatch):
    conf = tmp_path / "slurm.env"
    conf.write_text(
        "# cluster\nSPECDISTILL_PARTITION=from-file\nexport SPECDISTILL_TIME=02:00:00\n"
        "SPECDISTILL_GPUS_PER_NODE=8\nSPECDISTILL_ACCOUNT=proj42\n"
        "SPECDISTILL_SETUP='module load cuda; source ~/venv/bin/activate'\n"
    )
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_SLURM_CONFIG=str(conf),
              SPECDISTILL_PARTITION="from-env")  # fmt: skip
    s = slurm.load_settings()
    assert s["SPECDISTILL_SETUP"] == "module load cuda; source ~/venv/bin/activate"
    slurm.submit(pipeline_cfg(tmp_path / "run"), out=io.StringIO())
    jobs = shim_log(tmp_path)
    assert len(jobs) == 6
    for job in jobs:
        assert job["sbatch"]["--partition"] == "from-env"
        assert (job["sbatch"]["--time"], job["sbatch"]["--account"]) == ("02:00:00", "proj42")
    assert jobs[1]["sbatch"]["--gpus-per-node"] == "8"
    # the default file is ~/.config/specdistill/slurm.env
    home = tmp_path / "home" / ".config" / "specdistill"
    home.mkdir(parents=True)
    (home / "slurm.env").write_text("SPECDISTILL_PARTITION=home\n")
    env = {
        "HOME": str(tmp_path / "home"),
        "SPECDISTILL_TIME": "1",
        "SPECDISTILL_GPUS_PER_NODE": "0",
    }
    assert slurm.load_settings(env)["SPECDISTILL_PARTITION"] == "home"


@pytest.mark.parametrize("missing", sorted(SETTINGS))
def test_missing_setting_is_one_error_line_before_sbatch(tmp_path, monkeypatch, missing):
    slurm_env(monkeypatch, tmp_path, **{k: v for k, v in SETTINGS.items() if k != missing})
    with pytest.raises(ConfigError, match=f"^{missing} is not set"):
        slurm.submit(pipeline_cfg(tmp_path / "run"))
    assert shim_log(tmp_path) == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"SPECDISTILL_SLURM_CONFIG": "/nonexistent/slurm.env"}, "does not exist"),
        ({"SPECDISTILL_NODES": "two"}, "SPECDISTILL_NODES='two'"),
        ({"SPECDISTILL_TIME": "soon"}, "SPECDISTILL_TIME='soon'"),
        ({"SPECDISTILL_SBATCH_ARGS": "-q high"}, "SPECDISTILL_SBATCH_ARGS"),
    ],
)
def test_bad_settings_fail_before_sbatch(tmp_path, monkeypatch, settings, match):
    slurm_env(monkeypatch, tmp_path, **{**SETTINGS, **settings})
    with pytest.raises(ConfigError, match=match):
        slurm.submit(pipeline_cfg(tmp_path / "run"))
    assert shim_log(tmp_path) == []


def test_settings_file_lines_and_time_formats(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("SPECDISTILL_PARTITION=gpu\nsource ~/other.sh\n")
    with pytest.raises(ConfigError, match=r"bad.env:2: expected KEY=VALUE"):
        slurm.read_settings_file(bad)
    minutes = {"30": 30, "90:30": 91, "12:00:00": 720, "1-00": 1440, "2-01:30:00": 2970}
    assert {t: slurm.time_minutes(t) for t in minutes} == minutes
    assert slurm.sbatch_flags("--qos=high --exclusive --constraint a100") == {
        "qos": "high", "exclusive": True, "constraint": "a100"}  # fmt: skip


def test_no_sbatch_on_path_is_an_error(tmp_path, monkeypatch):
    slurm_env(monkeypatch, tmp_path, **SETTINGS)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="no `sbatch` on PATH"):
        slurm.submit(pipeline_cfg(tmp_path / "run"))


def test_finished_steps_are_not_submitted_again(tmp_path, monkeypatch):
    """A resubmitted command resumes: a step done with the same fingerprint is skipped and its
    dependants do not wait for it."""
    slurm_env(monkeypatch, tmp_path, **SETTINGS)
    run = tmp_path / "run"
    cfg = pipeline_cfg(run)
    gen = build_plan(cfg)[0]
    Path(gen.out_dir).mkdir(parents=True)
    (Path(gen.out_dir) / execute.DONE).write_text(json.dumps({"fingerprint": gen.fingerprint}))
    out = io.StringIO()
    ids = slurm.submit(cfg, out=out)
    assert ids["generate"] == "done" and "generate=done" in out.getvalue()
    dist, *_ = shim_log(tmp_path)
    assert dist["sbatch"]["--job-name"] == "specdistill-distill" and dist["dependency"] == []


def _wait(state: Path, timeout: float = 1500) -> dict[str, str]:
    """Until every job the shim knows is finished (ok, failed, cancelled)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        states = {p.name: p.read_text() for p in state.glob("job-*") if p.suffix == ""}
        if states and all(s not in ("pending", "running") for s in states.values()):
            return states
        time.sleep(1)
    raise AssertionError(f"jobs still running after {timeout} s: {states}")


TINY = [
    "++generate.dataset.limit=8", "++generate.max_new_tokens=8", "++generate.batch_size=4",
    "++generate.progress=false",
    "++distill.device=cpu", "++distill.logger=none", "++distill.max_steps=2",
    "++distill.eval_every=2", "++distill.save_every=2", "++distill.micro_batch_size=2",
    "++distill.max_seq_len=64", "++distill.eval.limit=4",
    "++validate.num_prompts=2", "++validate.max_new_tokens=8", "++validate.repeats=1",
    "++validate.step_time_iters=2", "++validate.plot=false", "++export.check.max_new_tokens=8",
]  # fmt: skip


def _layout(run: Path) -> set[str]:
    """The run folder as the pipeline defines it: each step's folder and files, one level down
    (generate's shard chunks, checkpoints and job logs depend on placement, not on the plan)."""
    skip = {".submitit", ".hydra", "checkpoints", "chunks"}
    out = set()
    for p in run.iterdir():
        if p.name in skip:
            continue
        out.add(p.name)
        if p.is_dir():
            out |= {f"{p.name}/{q.name}" for q in p.iterdir() if q.name not in skip}
    return out


def _rows(run: Path) -> list[str]:
    """summary.md without its figures: the rows' labels and the text lines."""
    text = (run / "summary.md").read_text().replace(str(run), "RUN")
    rows = []
    for line in text.splitlines():
        if line.startswith(("wall time", "Distilled with")):  # timings; best step
            continue
        if line.startswith("|"):
            line = "|".join(line.split("|")[:3])
        elif line.startswith("Predicted from"):  # priced with validate's timed c: speedups move
            line = re.sub(r"\d+(\.\d+)?", "N", line)
        rows.append(line)
    return rows


@pytest.mark.slow  # the whole chain on toy-tiny through submitit, distill as 2 "nodes": minutes
def test_slurm_chain_on_toy_tiny_matches_the_local_run(tmp_path, monkeypatch, toy_tiny):
    local = pipeline.run(pipeline_cfg(tmp_path / "local", *TINY, "launcher=local"))
    slurm_env(monkeypatch, tmp_path, dry=False, **SETTINGS, SPECDISTILL_NODES="2",
              SPECDISTILL_GENERATE_TASKS="2", SPECDISTILL_MASTER_PORT=str(free_port()))  # fmt: skip
    run = tmp_path / "run"
    t0 = time.time()
    ids = slurm.submit(pipeline_cfg(run, *TINY), out=io.StringIO())
    states = _wait(tmp_path / "shim")
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(run.glob(".submitit/*/*_log.*")))
    assert sorted(states.values()) == ["ok"] * 6, logs
    print(f"Slurm chain under the shims: {time.time() - t0:.0f} s")
    # distill ran as 2 "nodes" x 1 process, the rendezvous from the Slurm environment
    distill = json.loads((run / "distill" / "result.json").read_text())
    assert distill["world_size"] == 2 and distill["steps"] == 2
    assert "[distill] rank 1/2, rendezvous localhost:" in logs
    generate = json.loads((run / "generate" / "generation_config.json").read_text())
    assert generate["shard_count"] == 2  # the array: 2 shards, merged by the last one
    # the same run folder and the same summary as the local run
    assert _layout(run) == _layout(tmp_path / "local")
    pj = json.loads((run / "pipeline.json").read_text())
    assert list(pj["stages"]) == list(local.stages) == STEPS[:-1]
    assert set(pj["summary"]) == set(local.summary)
    assert _rows(run) == _rows(tmp_path / "local")
    exported = json.loads((run / "export" / "drafter" / "export.json").read_text())
    assert exported["drafter"] == str(run / "distill" / "best")
    assert exported["check"]["tokenizer_matches_target"] is True
    # a resubmission finds every step done and submits only the report
    out = io.StringIO()
    again = slurm.submit(pipeline_cfg(run, *TINY), out=out)
    assert [k for k, v in again.items() if v != "done"] == ["report"], (ids, again)
    assert _wait(tmp_path / "shim")[f"job-{again['report']}"] == "ok"
