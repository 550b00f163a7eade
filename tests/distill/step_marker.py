"""`torchrun ... step_marker.py ARGS`: the distill CLI, with rank 0 writing the number of each
finished optimizer step to $SPECDISTILL_TEST_STEP_FILE, so a test can signal a run mid-training;
every rank pauses $SPECDISTILL_TEST_STEP_PAUSE seconds after a step (toy-tiny's steps take
milliseconds: the pause spreads a run over seconds without changing what it computes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from specdistill.distill.train import stage as train


def _mark(step: int) -> None:
    if os.environ.get("RANK", "0") == "0":
        Path(os.environ["SPECDISTILL_TEST_STEP_FILE"]).write_text(f"{step}\n")
    time.sleep(float(os.environ.get("SPECDISTILL_TEST_STEP_PAUSE", "0")))


if __name__ == "__main__":
    train.STEP_HOOK = _mark
    train.main()
