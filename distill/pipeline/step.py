"""One step of a planned pipeline, in its own process: what each Slurm job runs.

    python -m specdistill.distill.pipeline.step RUN_DIR/plan/validate.yaml

loads the step that `build_plan` wrote (`specdistill ...` writes `RUN_DIR/plan/<step>.yaml`;
`specdistill plan=true` prints the same) and runs it through `run_step` (pipeline/execute.py),
as the local executor does: same config, same completion marker, same skip-if-done. `run_job` is the function the Slurm
executor submits (distill/pipeline/slurm.py); where the job runs only adds placement:

- a generate array task takes `shard.index/count` (the last shard to finish merges);
- a multi-process distill task takes the torch distributed environment from the Slurm one
  (`submitit.helpers.TorchDistributedEnvironment`: rank = SLURM_PROCID, world = SLURM_NTASKS,
  the rendezvous on the job's first node; MASTER_PORT from the job's setup or derived from the
  job id), which accelerate inside the stage picks up as it would torchrun's.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from specdistill.data.runtime import run_or_exit
from specdistill.distill.pipeline.execute import finish, run_step
from specdistill.distill.pipeline.plan import load_step

log = logging.getLogger("specdistill.pipeline")


def export_torch_distributed() -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from Slurm's
    task variables (a value already set, e.g. MASTER_PORT by the job's setup, is kept)."""
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    values = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or env.master_addr,
        "MASTER_PORT": str(env.master_port),  # MASTER_PORT if set, else derived from the job id
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
    }
    os.environ.update(values)
    return values


def run_job(
    step_file: str,
    shard_index: int | None = None,
    shard_count: int | None = None,
    distributed: bool = False,
) -> Any:
    """Run the step written at `step_file` (a Slurm job's function; also `python -m`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    step = load_step(step_file)
    if step.stage == "report":  # wall time: from the plan's writing (submission) to now
        wall = round(time.time() - Path(step_file).stat().st_mtime, 1)
        return finish(step, wall_seconds=wall)
    config = step.config
    if shard_count is not None:  # a generate array task: this task's shard of the prompts
        config = copy.deepcopy(config)
        config["shard"] = {"index": int(shard_index or 0), "count": int(shard_count)}
    if distributed:
        env = export_torch_distributed()
        log.info("[%s] rank %s/%s, rendezvous %s:%s", step.name, env["RANK"],
                 env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"])  # fmt: skip
    return run_step(step, config)


def _requeue_as_is(*args: Any, **kwargs: Any) -> Any:
    """submitit's checkpoint hook (a preempted or timed-out job, signalled with USR2): the job is
    requeued with the same arguments, since every step resumes from its own files (distill saves
    a checkpoint on the signal first, distill/train/preempt.py; generate keeps finished chunks)."""
    from submitit.helpers import DelayedSubmission

    return DelayedSubmission(run_job, *args, **kwargs)


run_job.checkpoint = _requeue_as_is  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"usage: python -m specdistill.distill.pipeline.step RUN_DIR/{'plan'}/STEP.yaml",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    out = run_or_exit(run_job, argv[0])
    if hasattr(out, "summary"):
        out = out.summary
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
