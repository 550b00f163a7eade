"""The Slurm executor: one job per planned step through submitit, chained with `afterok`.

    specdistill launcher=slurm run_dir=/runs/llama pair=llama3   # conf/sizing/llama3.yaml

Each job runs `specdistill.distill.pipeline.step.run_job` on `<run_dir>/plan/<step>.yaml`: the
same Step, the same config and the same `run_step` as the local executor, so the run is the
same wherever it runs. Each step's resources (pipeline/slurm_jobs.py) come from the pipeline's
`slurm` node (per step or stage, then every job's), then the cluster settings:

- generate: an array of `slurm.generate.array` (SPECDISTILL_GENERATE_TASKS) tasks (task i writes
  shard i; the last one to finish merges), one GPU each (`vllm.tensor_parallel_size` GPUs with
  backend=vllm);
- distill: `slurm.distill.nodes` (SPECDISTILL_NODES) nodes x `tasks_per_node` (default: the GPUs
  per node) tasks, one process each, the torch distributed environment taken from Slurm's (step.py);
- online, validate*, export: one GPU each; report (summary.md, report.png): no GPU;
- every job: requeued at most `max_num_timeout` times, signalled `signal_delay_s` before its limit.

A step already finished with the same fingerprint is not submitted again (a resubmitted
command resumes), and its dependants do not wait for it. Job ids are printed as `step=id`.

Cluster settings: the environment, else `$SPECDISTILL_SLURM_CONFIG` (default
`~/.config/specdistill/slurm.env`): KEY=VALUE lines in shell quoting; a variable set in the
environment wins over the file. A value a job needs that neither these nor the `slurm` node
give is one `error:` line, before sbatch.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specdistill.data.runtime import ConfigError
from specdistill.distill.pipeline.execute import is_done
from specdistill.distill.pipeline.plan import Step, build_plan, step_file, write_plan
from specdistill.distill.pipeline.slurm_jobs import Job, jobs, time_minutes
from specdistill.distill.pipeline.step import run_job

__all__ = ["load_settings", "resources", "submit", "time_minutes"]

# required unless the pipeline's `slurm` node gives them (slurm_jobs.py)
REQUIRED = ("SPECDISTILL_PARTITION", "SPECDISTILL_TIME", "SPECDISTILL_GPUS_PER_NODE")
OPTIONAL = (
    "SPECDISTILL_ACCOUNT",
    "SPECDISTILL_NODES",  # distill nodes (1)
    "SPECDISTILL_PROCS_PER_NODE",  # distill processes per node (the GPUs per node)
    "SPECDISTILL_GENERATE_TASKS",  # generate array size (1)
    "SPECDISTILL_CPUS_PER_TASK",
    "SPECDISTILL_SETUP",  # shell run first in every job: module load, venv, container wrapper
    "SPECDISTILL_SBATCH_ARGS",  # extra sbatch flags, e.g. --qos=high --constraint=a100
    "SPECDISTILL_SRUN_ARGS",  # extra srun flags, e.g. --container-image=...
    "SPECDISTILL_MASTER_PORT",  # distill rendezvous port (default: derived from the job id)
    "SPECDISTILL_PYTHON",  # the python a job runs (default: this one, sys.executable)
)


def settings_file(env: Mapping[str, str]) -> Path:
    given = env.get("SPECDISTILL_SLURM_CONFIG")
    if given:
        return Path(given).expanduser()
    return Path(env.get("HOME") or Path.home()) / ".config" / "specdistill" / "slurm.env"


def read_settings_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (optionally `export KEY=VALUE`), shell quoting and # comments."""
    values: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: {e}") from e
        if words[:1] == ["export"]:
            words = words[1:]
        if not words:
            continue
        key, eq, value = words[0].partition("=")
        if len(words) != 1 or not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"{path}:{n}: expected KEY=VALUE, got {line.strip()!r}")
        values[key] = value
    return values


def load_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The cluster settings: the file's, then the environment's on top. What a job needs and
    neither these nor the pipeline's `slurm` keys give is refused per step (slurm_jobs.py)."""
    env = os.environ if env is None else env
    path = settings_file(env)
    if env.get("SPECDISTILL_SLURM_CONFIG") and not path.is_file():
        raise ConfigError(f"SPECDISTILL_SLURM_CONFIG={path} does not exist")
    settings = read_settings_file(path) if path.is_file() else {}
    return settings | {k: env[k] for k in (*REQUIRED, *OPTIONAL) if k in env}


def sbatch_flags(text: str) -> dict[str, Any]:
    """SPECDISTILL_SBATCH_ARGS as submitit's `additional_parameters` (`--qos=high` -> qos)."""
    flags: dict[str, Any] = {}
    words = shlex.split(text)
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise ConfigError(f"SPECDISTILL_SBATCH_ARGS: {word!r}: use long flags, --key=value")
        key, eq, value = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
            value, i = words[i + 1], i + 1
        flags[key.replace("-", "_")] = value if (eq or value) else True
        i += 1
    return flags


def resources(
    steps: list[Step], cfg: DictConfig | None, env: Mapping[str, str] | None = None
) -> dict[str, Job]:
    """Each step's Slurm job, from the pipeline's `slurm` node over the cluster settings."""
    env = os.environ if env is None else env
    node = cfg.get("slurm") if cfg is not None else None
    return jobs(steps, node, load_settings(env), str(settings_file(env)))


def _parameters(step: Step, job: Job, settings: Mapping[str, str]) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for one step (dependency added by the caller)."""
    setup = [s for s in (settings.get("SPECDISTILL_SETUP"),) if s]
    if settings.get("SPECDISTILL_MASTER_PORT"):
        setup.append(f"export MASTER_PORT={shlex.quote(settings['SPECDISTILL_MASTER_PORT'])}")
    params: dict[str, Any] = {
        "job_name": f"specdistill-{step.name}",
        "partition": job.partition,
        "time": job.minutes,
        "nodes": job.nodes,
        "ntasks_per_node": job.tasks_per_node,
        "gpus_per_node": job.gpus_per_node or None,
        "signal_delay_s": job.signal_delay_s,
        "setup": setup,
        # the user's exact time string (submitit's own `time` is minutes, used for requeueing)
        "additional_parameters": {"time": job.time,
                                  **sbatch_flags(settings.get("SPECDISTILL_SBATCH_ARGS", ""))},
    }  # fmt: skip
    if settings.get("SPECDISTILL_ACCOUNT"):
        params["account"] = settings["SPECDISTILL_ACCOUNT"]
    if job.cpus_per_task is not None:
        params["cpus_per_task"] = job.cpus_per_task
    if settings.get("SPECDISTILL_SRUN_ARGS"):
        params["srun_args"] = shlex.split(settings["SPECDISTILL_SRUN_ARGS"])
    if job.array > 1:
        params["array_parallelism"] = job.array
    return params


def submit(cfg: DictConfig, out: Any = None) -> dict[str, str]:
    """Plan, write the step files, submit every unfinished step; returns {step: job id}."""
    out = out or sys.stdout
    settings = load_settings()
    steps = build_plan(cfg)
    placement = resources(steps, cfg)  # a missing or bad value stops here, nothing written
    params = {s.name: _parameters(s, placement[s.name], settings) for s in steps}
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise ConfigError(f"launcher=slurm: no `{tool}` on PATH; run on a Slurm login node")
    try:
        import submitit  # an optional extra (`.[slurm]`): imported only when submitting
    except ImportError as e:
        raise ConfigError('launcher=slurm needs submitit: pip install -e ".[slurm]"') from e

    write_plan(steps)
    run_dir = Path(steps[-1].out_dir)
    ids: dict[str, str] = {}
    for step in steps:
        if step.stage != "report" and is_done(step):
            ids[step.name] = "done"
            print(f"{step.name}=done", file=out, flush=True)
            continue
        deps = [ids[n] for n in step.needs if ids.get(n, "done") != "done"]
        job = placement[step.name]
        ex = submitit.SlurmExecutor(
            folder=run_dir / ".submitit" / "%j",
            max_num_timeout=job.max_num_timeout,
            python=settings.get("SPECDISTILL_PYTHON"),
        )
        ex.update_parameters(**params[step.name])
        if deps:
            ex.update_parameters(dependency="afterok:" + ":".join(deps))
        path = str(step_file(run_dir, step.name))
        n = job.array
        distributed = job.nodes * job.tasks_per_node > 1
        try:
            if n > 1:
                jobs = ex.map_array(run_job, [path] * n, list(range(n)), [n] * n)
                ids[step.name] = str(jobs[0].job_id).split("_")[0]
            else:
                ids[step.name] = str(ex.submit(run_job, path, None, None, distributed).job_id)
        except Exception as e:  # sbatch refused: say which step, and what is already queued
            queued = ", ".join(f"{k}={v}" for k, v in ids.items()) or "nothing"
            raise ConfigError(
                f"{step.name}: submission failed ({' '.join(str(e).split())}); queued: {queued}"
            ) from e
        print(f"{step.name}={ids[step.name]}", file=out, flush=True)
    if "export" in ids:
        exported = Path(next(s.out_dir for s in steps if s.name == "export")) / "drafter"
        print(f"exported drafter (when the chain finishes): {exported}", file=sys.stderr)
    print(f"summary (when the chain finishes): {run_dir / 'summary.md'}", file=sys.stderr)
    return ids
