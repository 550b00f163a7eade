"""Executing planned steps: what the local and the Slurm executors share.

`run_step` runs one Step (distill/pipeline/plan.py) in this process unless its folder holds a
completion marker for the same fingerprint; `finish` is the report step (pipeline.json,
summary.md, report.png). The local executor (pipeline/local.py) calls them for every step in
turn; a Slurm job (pipeline/step.py) calls them for the one step it was submitted for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, read_json
from specdistill.data.runtime import ConfigError, kept_threads, required
from specdistill.distill.pipeline.plan import STAGES, Step
from specdistill.distill.pipeline.report import summarize, write_report

log = logging.getLogger("specdistill.pipeline")

DONE = ".stage_done.json"


@dataclass
class PipelineResult:
    run_dir: str
    stages: dict[str, dict] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def _stage_runner(stage: str) -> Callable[[DictConfig], Any]:
    # Imported here on purpose, not to hide a cycle (the import contract test sees these too):
    # only the stage that runs is loaded, so `plan=true`, a Slurm submission on a login node and
    # a job running one step do not import the other four stages and their dependencies.
    if stage == "generate":
        from specdistill.data.generate.stage import run
    elif stage == "distill":
        from specdistill.distill.train.stage import run
    elif stage == "online":
        from specdistill.distill.online.stage import run
    elif stage == "validate":
        from specdistill.decode.validate.stage import run
    elif stage == "export":
        from specdistill.distill.export.stage import run
    else:
        raise ConfigError(f"stages contains {stage!r}; known stages are {', '.join(STAGES)}")
    return run


def is_done(step: Step) -> bool:
    """The step's folder says it finished with this exact fingerprint."""
    marker = Path(step.out_dir) / DONE
    return marker.is_file() and read_json(marker).get("fingerprint") == step.fingerprint


def distill_resume(cfg: DictConfig, fingerprint: str, out_dir: str) -> None:
    """A distill step rerun unchanged (a preempted or killed job) continues from its latest
    checkpoint (`resume: auto`); one whose config or upstream steps changed starts afresh over
    the old checkpoints, as any changed step reruns. The step's fingerprint, recorded in each
    checkpoint as `run_key`, tells them apart; every rank reads the same checkpoint."""
    from specdistill.distill.train.checkpoint import latest_config

    cfg.run_key = fingerprint
    if required(cfg, "resume") != "auto":
        return  # the user's own resume=true / false
    folder = Path(str(cfg.get("output_dir") or out_dir))
    saved = latest_config(folder / "checkpoints")
    if saved is not None and saved.get("run_key") != fingerprint:
        log.info("distill: the checkpoints in %s are another step's: starting afresh", folder)
        cfg.resume = False


def main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_step(step: Step, config: dict[str, Any] | None = None) -> dict:
    """Run one step unless its folder says it already finished with this fingerprint.

    The fingerprint covers the step's config and those of the steps whose output it reads: a
    step's config names its input by path only, so without them a re-run upstream (say, more
    distill steps into the same folder) would leave validate and export skipped with stale
    results. `config` replaces the step's config for where it runs (a Slurm array task's
    `shard.index/count`) without changing its fingerprint. Returns the stage's result file; in a
    process that does not finish the step (a rank > 0, a generate shard that did not merge) {}.
    """
    if is_done(step):
        log.info("[%s] already done in %s; skipping", step.name, step.out_dir)
        return read_json(step.result_path)
    log.info("[%s] running -> %s", step.name, step.out_dir)
    t0 = time.perf_counter()
    cfg = OmegaConf.create(config or step.config)
    if step.stage == "distill":
        distill_resume(cfg, step.fingerprint, step.out_dir)
    elif step.stage == "online":  # its state of another step is started afresh over (util.py)
        cfg.run_key = step.fingerprint
    with kept_threads():  # a stage's thread setting (generate threads=auto: 1) ends with it
        out = _stage_runner(step.stage)(cfg)
    if not main_process() or getattr(out, "merged", True) is False:
        return {}
    result = read_json(step.result_path)
    atomic_write_json(
        Path(step.out_dir) / DONE,
        {"fingerprint": step.fingerprint, "seconds": round(time.perf_counter() - t0, 1)},
    )
    return result


def finish(
    step: Step, stages: dict[str, dict] | None = None, wall_seconds: float | None = None
) -> PipelineResult:
    """The report step: pipeline.json, summary.md and report.png from the steps' results (read
    from their result files when not given, as a Slurm report job does)."""
    c = step.config
    run_dir = Path(c["run_dir"])
    if stages is None:
        missing = [p for p in c["results"].values() if not Path(p).is_file()]
        if missing:
            raise ConfigError(f"report: no result at {', '.join(missing)}: did a step fail?")
        stages = {name: read_json(p) for name, p in c["results"].items()}
    result = PipelineResult(run_dir=str(run_dir), stages=stages)
    result.summary = summarize(stages)
    serving, recipe = c.get("serving"), c.get("recipe")
    if serving is not None:
        result.summary["serving"], result.summary["recipe"] = serving, recipe
    result.wall_seconds = wall_seconds if wall_seconds is not None else 0.0
    atomic_write_json(run_dir / "pipeline.json", result)
    write_report(run_dir, stages, wall_seconds, serving, recipe)
    return result
