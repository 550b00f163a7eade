"""The whole pipeline's CLI (`specdistill`): generate (Seq-KD) -> distill -> [online] -> validate ->
export, on one pair.

`build_plan` (distill/pipeline/plan.py) composes each stage's config once: its primary config
(`conf/<stage>.yaml`) with the pipeline's pair, the serving mode's and recipe's overrides, the
run's folders and the keys under the stage's section. Stages hand off only through paths
(generate's output_dir is distill's `data.path`; distill's `best/` is validate's `pair.drafter`
and export's `drafter`), so the same steps run here in-process (`run`, the local executor,
distill/pipeline/local.py) or as Slurm jobs (`launcher=slurm`, distill/pipeline/slurm.py), each
through `run_step` (distill/pipeline/execute.py). Imports flow one way: plan <- execute <-
{local, slurm} <- this CLI; no stage imports the pipeline. A step whose folder holds a
completion marker for the same fingerprint is not run again, so a killed pipeline restarted
with the same command resumes at the first unfinished step. The run ends with
`summary.md` + `report.png` (distill/pipeline/report.py), `pipeline.json` and the exported
drafter under `run_dir/export/drafter`.

    specdistill pair=toy-tiny distill.max_steps=50     # run here
    specdistill serving=sampling plan=true             # print each step's final config, run nothing
    specdistill launcher=slurm run_dir=/runs/x         # one Slurm job per step (slurm/README.md)
"""

from __future__ import annotations

import json
import logging
import re
import sys

import hydra
from omegaconf import DictConfig

from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.data.stage_config import check_command_line
from specdistill.distill.pipeline import slurm
from specdistill.distill.pipeline.local import run, summary_markdown
from specdistill.distill.pipeline.plan import STAGES, build_plan, plan_text

__all__ = ["main", "run", "show_plan"]

LAUNCHERS = ("local", "slurm")


def show_plan(cfg: DictConfig) -> str:
    """`plan=true`: every step's final config and needs (with launcher=slurm, its resources)."""
    steps = build_plan(cfg)
    resources = None
    if _launcher(cfg) == "slurm":
        resources = {name: job.as_dict() for name, job in slurm.resources(steps, cfg).items()}
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
    pipeline.yaml, so a stage override is a forced add; so is a key of a `slurm` section
    (`slurm.distill.nodes=2`; slurm_jobs.py names a wrong one). Explicit `+`, `++` and `~` stay
    as given.
    """
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        head = key.split(".", 1)[0]
        if eq and "." in key and (head in STAGES or (head == "slurm" and key.count(".") > 1)):
            arg = f"++{arg}"
        out.append(arg)
    return out


def check_set_keys(argv: list[str]) -> None:
    """A stage's prompt set picked by name and a key of it in one command
    (`generate.dataset=chat_mix generate.dataset.limit=64`): Hydra would replace the name with
    the key's node, and the stage would read its default set with that key. Refused in one line
    naming the spelling that keeps both (the set as a whole node, as the sizings pick it)."""
    picked: dict[str, str] = {}
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        stage, _, rest = key.partition(".")
        if eq and stage in STAGES and rest == "dataset" and re.fullmatch(r"[\w.-]+", value):
            picked[stage] = value
    for arg in argv:
        key, eq, _ = arg.lstrip("+").partition("=")
        stage, _, rest = key.partition(".")
        if eq and stage in picked and rest.startswith("dataset."):
            name = picked[stage]
            raise ConfigError(
                f"{stage}.dataset={name} with {key}: a key over a set picked by name replaces "
                f"the name, and {stage} would read its default set; pick it as a node instead: "
                f"+dataset@{stage}.dataset={name} (without the + where the pair's sizing picks "
                f"{stage}'s set), then {key}=..."
            )


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
    run_or_exit(check_set_keys, sys.argv[1:])
    sys.argv[1:] = plan_mode_quiet(stage_keys_addable(sys.argv[1:]))
    check_command_line("pipeline")  # a pipeline key's typo; stage keys are checked per stage
    _hydra_main()


if __name__ == "__main__":
    main()
