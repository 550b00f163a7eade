"""The local executor: every step of the plan in this process, in order, then the report.

    specdistill pair=toy-tiny distill.max_steps=50

A step whose folder holds a completion marker for the same fingerprint is skipped
(pipeline/execute.py), so a killed run restarted with the same command resumes at the first
unfinished step.
"""

from __future__ import annotations

import time

from omegaconf import DictConfig

from specdistill.distill.pipeline.execute import PipelineResult, finish, main_process, run_step
from specdistill.distill.pipeline.plan import build_plan, write_plan
from specdistill.distill.pipeline.report import summary_markdown as _table


def run(cfg: DictConfig) -> PipelineResult:
    """Every step of the plan in-process, in order, then the report."""
    t0 = time.perf_counter()
    steps = build_plan(cfg)  # every config composed and checked before any step runs
    write_plan(steps)
    stages = {step.name: run_step(step) for step in steps[:-1]}
    if not main_process():  # under a launcher, rank 0 alone writes the run's report
        return PipelineResult(run_dir=steps[-1].out_dir, stages=stages)
    return finish(steps[-1], stages, round(time.perf_counter() - t0, 1))


def summary_markdown(result: PipelineResult) -> str:
    """The console's end-of-run table (the same text as summary.md)."""
    s = result.summary
    return _table(
        result.run_dir, result.stages, result.wall_seconds, s.get("serving"), s.get("recipe")
    )
