"""Small serving helpers of the online stage: padding, atomic export, resume, signals, threads."""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specdistill.data.io import guard_write, param_bytes, replace_dir
from specdistill.data.models.checkpoints import check_saved_file
from specdistill.data.runtime import ConfigError
from specdistill.distill.train.setup import init_logger

log = logging.getLogger("specdistill.online")


def saved_state(state_path: Path, resume: bool, fp: str) -> dict | None:
    """The checkpoint to resume from (resume=true and one exists), refused when another config
    or stream wrote it (`fp`: the run's fingerprint)."""
    if resume and state_path.exists():
        check_saved_file(
            "resume=true", state_path, "delete it (and drafter/) to start afresh, or resume=false"
        )
        state = torch.load(state_path, weights_only=False)
        if state["fingerprint"] != fp:
            raise ConfigError(
                f"resume=true but {state_path} was written by a different config or stream: "
                "resume with the same settings, or use a fresh output_dir"
            )
        return state
    if resume:
        log.warning("resume=true but no %s: starting fresh", state_path)
    return None


def export_atomic(drafter, tok, path: Path) -> None:
    """save_pretrained into a temp folder renamed over `path`: never half a checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with guard_write(path, param_bytes(drafter), cleanup=(tmp,)):
        drafter.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    replace_dir(tmp, path)


class StopOnSignal:
    """SIGINT/SIGTERM set a flag; the loop checkpoints after the current batch and exits."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("signal %d: checkpointing after the current batch", signum)
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def wandb_tracker(cfg: DictConfig, device: torch.device):
    """wandb through accelerate's tracker and the distill stage's own set-up (offline without a
    key); None with logger=none."""
    if cfg.logger.name != "wandb":
        return None
    from accelerate import Accelerator

    acc = Accelerator(cpu=device.type == "cpu", log_with="wandb", project_dir=str(cfg.output_dir))
    init_logger(acc, cfg)
    return acc
