"""How the drafter is spread over the processes: one of the two parts a distill run is made of
(the other, what it is trained against, is train/objective.py); `choose_parts`
(train/parts.py) picks both once from the settings.

Three spreads implement `Spread`, one module each:

- replicated (train/replicated.py): one process, or DDP over several (accelerate wraps the
  drafter in DDP exactly when there are several), gradients all-reduced once per window;
- ZeRO-2/3 (train/zero.py): a DeepSpeed engine owns the accumulation boundary, clipping and,
  at stage 3, the head's weight;
- FSDP2 (train/fsdp.py): torch's `fully_shard` per decoder layer, gradients reduce-scattered
  every micro-batch, sharded checkpoints.

Whatever the spread, the gradient of a step is exactly sum(token losses) / the window's tokens
across processes (train/step.py): each spread says by how much the loss is scaled to undo its
own averaging, where the accumulation boundary falls and how the gradients are clipped.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator
    from omegaconf import DictConfig


class Spread(Protocol):
    """How the drafter's weights, gradients and optimizer state are laid out over processes."""

    # a forward gathers shards from every rank, so every rank must run it (and generate) together
    lockstep: bool
    # the LM head's weight is whole outside the forward: the head may run at loss positions only
    head_outside: bool
    # the trained drafter in memory is the whole model (else best/ is read back from disk)
    holds_whole_model: bool

    def make_accelerator(self, cfg: DictConfig, cuda: bool, kwargs: dict[str, Any]) -> Accelerator:
        """accelerate's Accelerator for this spread, from the stage's common `kwargs`."""

    def before_load(self, cuda: bool) -> None:
        """What must exist before any model loads (a process group)."""

    def shard(self, drafter: torch.nn.Module, accelerator: Accelerator) -> None:
        """Spread the drafter in place before the optimizer sees its parameters (FSDP2)."""

    def wrap(
        self, drafter: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Accelerator
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """(model, optimizer) as the loop steps them (accelerate's wrappers where it owns them)."""

    def loss_scale(self, world: int, grad_accum: int) -> int:
        """The factor that undoes this spread's averaging of the gradients."""

    def boundary(
        self, accelerator: Accelerator, model: torch.nn.Module, a: int, grad_accum: int, step: int
    ) -> AbstractContextManager[Any]:
        """The context micro-batch `a` of the window runs its backward in."""

    def clip(
        self, accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None
    ) -> float | torch.Tensor | None:
        """Clip the window's gradients to `max_norm` (None: not clipped); the norm before."""

    def sharded(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        """(model, optimizer) when their checkpoints are this spread's own (train/fsdp.py)."""
