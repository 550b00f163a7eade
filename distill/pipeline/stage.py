"""The whole pipeline: generate (Seq-KD) -> distill -> [online] -> validate -> export, on one pair.

`build_plan` (distill/pipeline/plan.py) composes each stage's config once: its primary config
(`conf/<stage>.yaml`) with the pipeline's pair, the serving mode's and recipe's overrides, the
run's folders and the keys under the stage's section. Stages hand off only through paths
(generate's output_dir is distill's `data.path`; distill's `best/` is validate's `pair.drafter`
and export's `drafter`), so the same steps run here in-process (`run`, the local executor) or as
Slurm jobs (`launcher=slurm`, distill/pipeline/slurm.py), each through `run_step`. A step whose
folder holds a completion marker for the same fingerprint is not run again, so a killed pipeline
restarted with the same command resumes at the first unfinished step. The run ends with
`summary.md` + `report.png` (distill/pipeline/report.py), `pipeline.json` and the exported
drafter under `run_dir/export/drafter`.

    specdistill pair=toy-tiny distill.max_steps=50     # run here
    specdistill serving=sampling plan=true             # print each step's final config, run nothing
    specdistill launcher=slurm run_dir=/runs/x         # one Slurm job per step (slurm/README.md)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, read_json
from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.distill.pipeline.plan import (
    STAGES,
    Step,
    build_plan,
    compose_stage,
    flatten_overrides,
    format_override,
    plan_text,
    serving_overrides,
    write_plan,
)
from specdistill.distill.pipeline.report import summarize, write_report

__all__ = [
    "STAGES",
    "ConfigError",
    "PipelineResult",
    "compose_stage",
    "flatten_overrides",
    "format_override",
    "run",
    "run_step",
    "serving_overrides",
]

log = logging.getLogger("specdistill.pipeline")

DONE = ".stage_done.json"
LAUNCHERS = ("local", "slurm")


@dataclass
class PipelineResult:
    run_dir: str
    stages: dict[str, dict] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def _stage_runner(stage: str) -> Callable[[DictConfig], Any]:
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


def _main_process() -> bool:
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
    import torch

    threads = torch.get_num_threads()
    try:
        out = _stage_runner(step.stage)(OmegaConf.create(config or step.config))
    finally:  # a stage's thread setting (generate threads=auto: 1) must not slow the next one
        torch.set_num_threads(threads)
    if not _main_process() or getattr(out, "merged", True) is False:
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


def run(cfg: DictConfig) -> PipelineResult:
    """The local executor: every step of the plan in-process, in order, then the report."""
    t0 = time.perf_counter()
    steps = build_plan(cfg)  # every config composed and checked before any step runs
    if cfg.get("vllm", False) and any(s.stage == "export" for s in steps):
        from specdistill.data.generate.vllm_engine import require_vllm

        require_vllm("vllm=true")  # the export's vLLM check would fail only after every stage
    write_plan(steps)
    stages = {step.name: run_step(step) for step in steps[:-1]}
    if not _main_process():  # under a launcher, rank 0 alone writes the run's report
        return PipelineResult(run_dir=steps[-1].out_dir, stages=stages)
    return finish(steps[-1], stages, round(time.perf_counter() - t0, 1))


def summary_markdown(result: PipelineResult) -> str:
    """The console's end-of-run table (the same text as summary.md)."""
    from specdistill.distill.pipeline.report import summary_markdown as table

    s = result.summary
    return table(
        result.run_dir, result.stages, result.wall_seconds, s.get("serving"), s.get("recipe")
    )


def show_plan(cfg: DictConfig) -> str:
    """`plan=true`: every step's final config and needs (with launcher=slurm, its resources)."""
    steps = build_plan(cfg)
    resources = None
    if _launcher(cfg) == "slurm":
        from specdistill.distill.pipeline import slurm

        resources = slurm.resources(steps, slurm.load_settings())
    return plan_text(steps, resources)


def _launcher(cfg: DictConfig) -> str:
    launcher = str(cfg.get("launcher") or "local")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher={launcher!r}: use launcher=local or launcher=slurm")
    return launcher


def _dispatch(cfg: DictConfig) -> None:
    if cfg.get("plan"):
        print(show_plan(cfg))
    elif _launcher(cfg) == "slurm":
        from specdistill.distill.pipeline import slurm

        slurm.submit(cfg)
    else:
        result = run(cfg)
        print(summary_markdown(result))
        print(json.dumps(result.summary, indent=2))


@hydra.main(config_path="pkg://specdistill.conf", config_name="pipeline", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    run_or_exit(_dispatch, cfg)


def stage_keys_addable(argv: list[str]) -> list[str]:
    """`distill.lmbda=0.5` on the command line as `++distill.lmbda=0.5`.

    The pipeline config's stage sections are open dicts: which keys a stage takes is its own
    config's business, checked when the stage is composed (an unknown key is an `error:` line
    naming the stage). Hydra's struct mode would refuse any key not already written in
    pipeline.yaml, so a stage override is a forced add; explicit `+`, `++` and `~` stay as given.
    """
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        if eq and "." in key and key.split(".", 1)[0] in STAGES:
            arg = f"++{arg}"
        out.append(arg)
    return out


def plan_mode_quiet(argv: list[str]) -> list[str]:
    """With `plan=true`, Hydra writes no config copies, log files or run folder: the plan is
    printed, nothing else happens (a multirun still makes its sweep folders)."""
    if not any(a.lower() in ("plan=true", "++plan=true") for a in argv):
        return argv
    given = {a.partition("=")[0].lstrip("+") for a in argv}
    extra = [
        o
        for o in ("hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none")
        if o.partition("=")[0] not in given
    ]
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not multirun and "hydra.run.dir" not in given:
        extra.append("hydra.run.dir=.")
    return [*argv, *extra]


def main() -> None:
    """Console script `specdistill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.argv[1:] = plan_mode_quiet(stage_keys_addable(sys.argv[1:]))
    _hydra_main()


if __name__ == "__main__":
    main()
