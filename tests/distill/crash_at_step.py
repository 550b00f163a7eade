"""`torchrun ... crash_at_step.py ARGS`: the distill CLI, hard-killed (os._exit, no cleanup)
on every rank right after optimizer step $SPECDISTILL_TEST_CRASH_AT, as a SIGKILL would."""

from __future__ import annotations

import os

from specdistill.distill.train import stage as train


def _crash(step: int) -> None:
    if step == int(os.environ["SPECDISTILL_TEST_CRASH_AT"]):
        os._exit(9)


if __name__ == "__main__":
    train.STEP_HOOK = _crash
    train.main()
