"""The drafter whole on every process: one process, or DDP over several (train/spread.py).

accelerate wraps the drafter in DDP exactly when there are several processes; gradients are
all-reduced once per accumulation window (`no_sync` before the last micro-batch; for one process
it is a no-op). DDP averages the gradients over processes, so the loss is scaled by the world
size to keep the gradient sum(token losses) / the window's tokens (train/step.py).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator
    from omegaconf import DictConfig


class Replicated:
    """One process, or DDP over several: every process holds the whole drafter."""

    lockstep = False
    head_outside = True
    holds_whole_model = True

    def make_accelerator(self, cfg: DictConfig, cuda: bool, kwargs: dict[str, Any]) -> Accelerator:
        from accelerate import Accelerator

        return Accelerator(**kwargs)

    def before_load(self, cuda: bool) -> None:
        """Nothing: accelerate starts the process group of a multi-process launch."""

    def shard(self, drafter: torch.nn.Module, accelerator: Accelerator) -> None:
        """Nothing: the drafter stays whole."""

    def wrap(
        self, drafter: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Accelerator
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return accelerator.prepare(drafter, opt)

    def loss_scale(self, world: int, grad_accum: int) -> int:
        return world

    def boundary(
        self, accelerator: Accelerator, model: torch.nn.Module, a: int, grad_accum: int, step: int
    ) -> AbstractContextManager[Any]:
        """Gradients all-reduced with the window's last micro-batch only."""
        if a == grad_accum - 1:
            return contextlib.nullcontext()
        return accelerator.no_sync(model)

    def clip(
        self, accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None
    ) -> float | torch.Tensor | None:
        if max_norm is None:
            return None
        return accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def sharded(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        return None
