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


def saved_state(
    state_path: Path, resume: bool | str, fp: str, run_key: str | None = None
) -> dict | None:
    """The checkpoint to resume from, refused when another config or stream wrote it (`fp`: the
    run's fingerprint). `resume`: auto (the default) continues a state of the same run, so a
    preempted job's rerun of the same command loses nothing; true insists on one; false starts
    afresh over whatever is there. `run_key`: the pipeline step's fingerprint (its upstream
    steps included): under auto a state another step wrote (a re-distilled drafter at the same
    path) is started afresh over, as the pipeline reruns any changed step."""
    if resume is False:
        return None
    if not state_path.exists():
        if resume is True:
            log.warning("resume=true but no %s: starting fresh", state_path)
        return None
    asked = f"resume={str(resume).lower()}"
    check_saved_file(asked, state_path, "delete it (and drafter/) to start afresh, or resume=false")
    state = torch.load(state_path, weights_only=False)
    if resume == "auto" and state.get("run_key") != run_key:
        log.info("%s is another pipeline step's: starting afresh", state_path)
        return None
    if state["fingerprint"] != fp:
        raise ConfigError(
            f"{asked} but {state_path} was written by a different config or stream: rerun with "
            "the same settings to continue it, resume=false to start afresh over it, or use a "
            "fresh output_dir"
        )
    return state


def save_checkpoint(
    out: Path, state_file: str, state: dict, drafter, tok, rows: list[dict]
) -> None:
    """A run's checkpoint, each part atomic: the state file replaced whole, then the drafter
    export (`out/drafter`) and `online.jsonl` (the stage's and the served loop's alike)."""
    import os

    from specdistill.distill.online.report import write_jsonl

    tmp = out / f".{state_file}.tmp"
    with guard_write(out / state_file, cleanup=(tmp,)):  # no half state file left
        torch.save(state, tmp)
        os.replace(tmp, out / state_file)
    export_atomic(drafter, tok, out / "drafter")
    write_jsonl(out / "online.jsonl", rows)


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
