"""Preemptible distill runs: a stop signal saves the current step and exits; the rerun resumes.

Slurm preempts or times out a job by sending SIGTERM (SIGUSR1 first with `--signal=USR1@N`;
submitit asks for USR2), and a requeued job runs the same command again. So distill takes
SIGTERM, SIGUSR1 and SIGUSR2 as "stop at the next optimizer step": every process agrees on
that step (a max over processes), saves its checkpoint there (collective), and exits with
128 + the signal. The rerun of the same config finds that checkpoint and resumes without a
flag (`resume: auto`, train/progress.py): nothing finished is lost and no step is trained
twice, since a step's batches are a function of (seed, step, rank) (train/data.py).

A handler installed before ours (submitit's requeue on USR2) is called after the save, so the
launcher still requeues the job. Signals are caught in the main thread only (a run inside a
worker thread keeps the process's own handlers).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch

log = logging.getLogger("specdistill.distill")

# SIGUSR2: submitit's warning before a time limit or preemption (`--signal=USR2@90`)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Remembers the first stop signal; `install` / `restore` bracket one training loop."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._caught)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _caught(self, signum: int, frame: Any) -> None:
        if not self.signum:
            log.warning(
                "%s: saving a checkpoint after this optimizer step, then exiting (a rerun of the "
                "same command resumes there)",
                signal.Signals(signum).name,
            )
        self.signum = self.signum or signum

    def agreed(self, accelerator: Any) -> int:
        """The stop signal any process caught (0: none): every process stops at the same step.
        Collective when there are several processes."""
        if accelerator.num_processes == 1:
            return self.signum
        flag = torch.tensor([self.signum], device=accelerator.device, dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def exit(self, signum: int) -> None:
        """After the save: hand the signal to the handler that was there before ours (e.g.
        submitit's requeue), else exit as the signal would have, with status 128 + signum."""
        previous = self._previous.get(signum)
        self.restore()
        if callable(previous):
            previous(signum, None)
        raise SystemExit(128 + signum)
