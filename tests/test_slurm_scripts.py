"""The Slurm scripts run as Slurm would run them, without a cluster.

`sbatch`, `srun` and `scontrol` are shims (tests/slurm_shims/) that record their command line
and run the job locally with the SLURM_* variables a real allocation sets; "nodes" are local
processes, so the multi-node distill rendezvous is exercised for real with 2 CPU processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS = Path(__file__).resolve().parent / "slurm_shims"
SETTINGS = {
    "SPECDISTILL_PARTITION": "gpu",
    "SPECDISTILL_TIME": "01:00:00",
    "SPECDISTILL_GPUS_PER_NODE": "1",
}


def _env(tmp_path: Path, shims: bool = True, **extra: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDISTILL_", "SLURM_"))}
    env |= {
        "SPECDISTILL_HOME": os.environ.get(
            "SPECDISTILL_HOME", str(Path.home() / ".cache/specdistill")
        ),
        "HOME": str(tmp_path / "home"),  # no ~/.config/specdistill/slurm.env from the user
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "PATH": f"{SHIMS}:{path}" if shims else path,
        "SHIM_LOG": str(tmp_path / "shim.log"),
        "SHIM_STATE": str(tmp_path / "shim"),
    }
    return env | extra


def _log(tmp_path: Path) -> list[dict]:
    log = tmp_path / "shim.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _pipeline(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "slurm" / "pipeline.sh"), str(tmp_path / "run"), *args],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


def test_generate_array_shards_merge(tmp_path, toy_tiny):
    from datasets import load_from_disk

    out = tmp_path / "seqkd"
    env = _env(tmp_path, shims=False)
    args = [
        "pair=toy-tiny",
        f"output_dir={out}",
        "dataset.limit=6",
        "max_new_tokens=4",
        "batch_size=4",
        "progress=false",
    ]
    for task in (0, 1):
        env |= {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "2"}
        subprocess.run(
            ["bash", str(ROOT / "slurm" / "generate_array.sbatch"), *args],
            env=env,
            check=True,
            capture_output=True,
        )
    ds = load_from_disk(str(out))
    assert sorted(ds["prompt_index"]) == list(range(6))


@pytest.mark.parametrize("missing", sorted(SETTINGS))
def test_missing_setting_is_an_error_before_sbatch(tmp_path, missing):
    settings = {k: v for k, v in SETTINGS.items() if k != missing}
    proc = _pipeline(tmp_path, _env(tmp_path, SHIM_DRY="1", **settings), "pair=toy-tiny")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {missing} is not set")
    assert _log(tmp_path) == []  # sbatch was never called


def test_missing_run_dir_is_an_error(tmp_path):
    proc = _pipeline(tmp_path, _env(tmp_path, SHIM_DRY="1", **SETTINGS))  # RUN_DIR given
    assert proc.returncode == 0
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "pipeline.sh"), "pair=toy-tiny"],
                          env=_env(tmp_path, **SETTINGS), capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("error: RUN_DIR is missing")


def test_settings_file_with_environment_taking_precedence(tmp_path):
    conf = tmp_path / "slurm.env"
    conf.write_text(
        "SPECDISTILL_PARTITION=from-file\nSPECDISTILL_TIME=02:00:00\n"
        "SPECDISTILL_GPUS_PER_NODE=8\nSPECDISTILL_ACCOUNT=proj42\n"
    )
    env = _env(tmp_path, SHIM_DRY="1", SPECDISTILL_SLURM_CONFIG=str(conf),
               SPECDISTILL_PARTITION="from-env")  # fmt: skip
    assert _pipeline(tmp_path, env, "pair=toy-tiny").returncode == 0
    jobs = _log(tmp_path)
    assert len(jobs) == 6
    for job in jobs:
        assert {"--partition=from-env", "--time=02:00:00", "--account=proj42"} <= set(job["argv"])
    assert "--gpus-per-node=8" in jobs[1]["argv"]


def test_pipeline_chains_stages_with_afterok_and_hands_off_paths(tmp_path):
    env = _env(tmp_path, SHIM_DRY="1", SPECDISTILL_NODES="4", SPECDISTILL_GENERATE_TASKS="8",
               **SETTINGS)  # fmt: skip
    proc = _pipeline(tmp_path, env, "pair=llama3", "generate.max_new_tokens=512",
                     "distill.deepspeed=zero3", "export.dtype=bf16")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    gen, dist, base, val, exp, rep = _log(tmp_path)
    ids = dict(line.split("=") for line in proc.stdout.split())
    assert [ids[k] for k in ("generate", "distill", "validate_base", "validate", "export")] == [
        j["job_id"] for j in (gen, dist, base, val, exp)
    ]
    run = tmp_path / "run"
    assert "--array=0-7" in gen["argv"] and gen["dependency"] == []
    assert gen["args"] == ["pair=llama3", f"output_dir={run}/generate", "max_new_tokens=512"]
    assert dist["dependency"] == [gen["job_id"]] and "--nodes=4" in dist["argv"]
    assert dist["script"].endswith("slurm/distill.sbatch")
    assert dist["args"] == ["pair=llama3", f"output_dir={run}/distill",
                            f"data.path={run}/generate", "deepspeed=zero3"]  # fmt: skip
    assert base["dependency"] == [] and f"output_dir={run}/validate_base" in base["args"]
    assert val["dependency"] == [dist["job_id"]]
    assert f"pair.drafter={run}/distill/best" in val["args"]
    assert exp["dependency"] == [val["job_id"]]
    assert exp["args"] == ["pair=llama3", f"drafter={run}/distill/best",
                           f"report={run}/validate/report.json",
                           f"output_dir={run}/export/drafter", "overwrite=true", "dtype=bf16"]  # fmt: skip
    assert rep["dependency"] == [base["job_id"], exp["job_id"]]
    assert any("specdistill.distill.pipeline.report" in a for a in rep["argv"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # the whole chain on toy-tiny, distill as 2 "nodes" x 1 CPU process: minutes
def test_chained_toy_tiny_run_ends_with_an_exported_drafter(tmp_path, toy_tiny):
    port = str(_free_port())
    env = _env(tmp_path, SPECDISTILL_NODES="2", SPECDISTILL_GENERATE_TASKS="2",
               SPECDISTILL_MASTER_PORT=port, **SETTINGS)  # fmt: skip
    proc = _pipeline(
        tmp_path, env, "pair=toy-tiny",
        "generate.dataset.limit=8", "generate.max_new_tokens=8", "generate.batch_size=4",
        "generate.progress=false",
        "distill.device=cpu", "distill.logger=none", "distill.max_steps=2", "distill.eval_every=2",
        "distill.save_every=2", "distill.micro_batch_size=2", "distill.max_seq_len=64",
        "distill.eval.limit=4",
        "validate.num_prompts=2", "validate.max_new_tokens=8", "validate.repeats=1",
        "validate.step_time_iters=2", "validate.plot=false", "export.check.max_new_tokens=8",
    )  # fmt: skip
    state = tmp_path / "shim"
    logs = "\n".join(p.read_text() for p in sorted(state.glob("slurm-*.out")))
    assert proc.returncode == 0, proc.stderr + logs
    assert sorted(p.read_text() for p in state.glob("job-*")) == ["ok"] * 6, logs
    run = tmp_path / "run"
    # The rendezvous came from the Slurm environment: first node, derived port, node ranks.
    (srun,) = [r for r in _log(tmp_path) if "srun" in r]
    assert (srun["MASTER_ADDR"], srun["MASTER_PORT"]) == ("node1", port)
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1"} <= set(srun["srun"])
    for rank in (0, 1):
        assert (f"[node {rank}/2] torchrun --nnodes=2 --node_rank={rank} --nproc_per_node=1 "
                f"--master_addr=127.0.0.1 --master_port={port}") in logs  # fmt: skip
    distill = json.loads((run / "distill" / "result.json").read_text())
    assert distill["world_size"] == 2 and distill["steps"] == 2
    exported = json.loads((run / "export" / "drafter" / "export.json").read_text())
    assert exported["drafter"] == str(run / "distill" / "best")
    assert exported["check"]["tokenizer_matches_target"] is True
    assert (run / "export" / "drafter" / "model.safetensors").exists()
    summary = (run / "summary.md").read_text()
    assert "| alpha, greedy | decode-time acceptance |" in summary
    assert str(run / "export" / "drafter") in summary
