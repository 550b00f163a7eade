"""`torchrun ... rehearsal_crash.py RUN/plan/distill.yaml`: a pipeline step as a Slurm job runs it
(specdistill.distill.pipeline.step), hard-killed (os._exit, no cleanup) on every rank right after
optimizer step $SPECDISTILL_TEST_CRASH_AT, as a node lost mid-job would leave it."""

from __future__ import annotations

import os

from specdistill.distill.pipeline import step
from specdistill.distill.train import stage as train


def _crash(done: int) -> None:
    if done == int(os.environ["SPECDISTILL_TEST_CRASH_AT"]):
        os._exit(9)


if __name__ == "__main__":
    train.STEP_HOOK = _crash
    step.main()
