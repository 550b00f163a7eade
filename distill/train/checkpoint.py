"""Atomic training checkpoints and `save_pretrained` exports for the distill stage.

A checkpoint is accelerate's `save_state` (model, optimizer, scheduler and every process's RNG
states; DeepSpeed shards under ZeRO, and under FSDP2 each process's shards of the model and
optimizer in `fsdp/`, train/fsdp.py) plus `trainer_state.json` (step, data position, best alpha,
history). It is written to a temp folder and renamed into place, and `latest` names the newest
complete one, so a run killed mid-save resumes from the previous checkpoint, never half of one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdistill.data.io import (
    atomic_write_json,
    atomic_write_text,
    guard_write,
    param_bytes,
    replace_dir,
)
from specdistill.data.models.checkpoints import check_checkpoint_files
from specdistill.distill.train import fsdp, mask_row

STATE_FILE = "trainer_state.json"


def save_checkpoint(
    accelerator,
    root: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    sharded: tuple[Any, Any] | None = None,
) -> Path:
    """Collective: every process calls it. `sharded`: (model, optimizer) of an FSDP2 run, which
    accelerate does not hold (train/fsdp.py). Returns the checkpoint folder."""
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with guard_write(final, cleanup=(tmp,)):  # a failed save leaves no half folder behind
        accelerator.save_state(str(tmp))
        if sharded is not None:
            fsdp.save_sharded(*sharded, tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with guard_write(final, cleanup=(tmp,)):
            atomic_write_json(tmp / STATE_FILE, state)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        atomic_write_text(root / "latest", final.name + "\n")
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[: max(0, len(done) - max(1, keep))]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


def latest_config(root: Path) -> dict[str, Any] | None:
    """The run config the latest checkpoint under `root` recorded (train/progress.py
    `run_config`); None when there is no checkpoint, {} for one written before configs were."""
    latest = latest_checkpoint(root)
    return None if latest is None else read_state(latest).get("config", {})


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer state alone (nothing loaded): what resume checks first."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(
    accelerator, path: Path, sharded: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG in place (`sharded`: an FSDP2 run's model and
    optimizer, read from their shards); return the trainer state."""
    fix = "delete that folder and rerun (the run then starts afresh)"
    check_checkpoint_files("resume checkpoint", path, fix)
    accelerator.load_state(str(path))
    if sharded is not None:
        fsdp.load_sharded(*sharded, path)
    return read_state(path)


def export_pretrained(accelerator, model, tokenizer, path: Path) -> Path:
    """`save_pretrained` (+ tokenizer) into `path`, atomically replacing what was there.

    Collective: under ZeRO-3 and FSDP2 the full state dict is gathered from every process.
    """
    path = Path(path)
    if fsdp.is_sharded(model):
        state = fsdp.full_state_dict(model)
    else:
        state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # a parallel drafter's trainable mask row is written into its plain embedding
        state = mask_row.plain_state_dict(accelerator.unwrap_model(model), state)
        state = _share_tied(accelerator.unwrap_model(model), state)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        with guard_write(path, param_bytes(unwrapped), cleanup=(tmp,)):
            unwrapped.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, path)
    accelerator.wait_for_everyone()
    return path


def _share_tied(module, state: dict[str, Any]) -> dict[str, Any]:
    """Point tied parameters' entries at one tensor again (DeepSpeed's gathered state dict
    clones them), so save_pretrained drops the duplicates exactly as in a plain run."""
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state
