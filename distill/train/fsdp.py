"""FSDP2 for the distill stage (`fsdp=true`): the drafter's parameters, gradients and optimizer
state sharded over the processes with torch's `fully_shard`, on GPUs (NCCL) and on CPU (gloo).

Why the stage shards the model itself rather than through accelerate's FSDP plugin: accelerate
(1.16) builds FSDP only for accelerator devices (its FSDP branch covers the multi-GPU/XPU/...
types, not multi-CPU: on CPU it ignores the plugin and wraps DDP), and a distill run must
behave the same on a laptop, in CI and on a node. accelerate still owns
devices, processes, the RNG states of a checkpoint and logging; the model and its optimizer
are never passed through `accelerator.prepare`.

Layout. Each decoder layer is its own group, gathered for its forward and again for its
backward only. The root group (embeddings, final norm, LM head; a tied head must share its
embedding's group) stays whole from the forward to the end of the backward
(`reshard_after_forward=False`), so the masked head, the chunked loss and the draft-vocabulary
head read the head's weight outside the model's forward exactly as one process does
(train/logits.final_hidden), and their gradients reach the root group's reduce-scatter.

Accumulation. Gradients are reduce-scattered after every micro-batch, so each process holds its
shard of the window's sum, never the whole model's gradient. The reduce-scatter averages over
processes as DDP's all-reduce does, so the step's loss scaling is DDP's (train/step.py).

Checkpoints. torch.distributed.checkpoint writes each process's shards of the model and the
optimizer (`fsdp/` inside accelerate's `save_state` folder, which keeps the scheduler and the
RNG states), and reads them back into the same layout. An export (best/, final/) gathers the
full state dict on the main process only (`full_state_dict`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdistill.data.runtime import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from omegaconf import DictConfig

SHARDS_DIR = "fsdp"  # inside a checkpoint folder: the model's and optimizer's shards


def check_fsdp(fsdp: bool, deepspeed: bool, mapped: bool, parallel: bool) -> None:
    """What FSDP2 does not serve in this stage, one line each, before anything loads (vLLM
    rollouts, which read whole weights: train/rollouts.check_rollouts)."""
    if not fsdp:
        return
    why = (
        "DeepSpeed shards the model itself: choose one (deepspeed=none or fsdp=false)"
        if deepspeed
        else "a drafter with its own tokenizer runs the TLI loss through the vocabulary "
        "mapping, not tested sharded; use deepspeed=zero2 or fsdp=false"
        if mapped
        else "a parallel drafter's trainable mask row lives outside the sharded embedding; "
        "use deepspeed=zero2 or fsdp=false"
        if parallel
        else None
    )
    if why:
        raise ConfigError(f"fsdp=true: {why}")


def ensure_process_group(cuda: bool) -> None:
    """FSDP2 always runs over a process group: accelerate starts one for several processes;
    a lone process (no launcher, or `torchrun --nproc_per_node 1`) gets a world of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from specdistill.distill.train.zero import _single_process_env

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        _single_process_env()
    dist.init_process_group("nccl" if cuda else "gloo")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder's layers, each its own FSDP group; a model without a `layers` list is
    refused (it would be one group, gathered whole for every forward)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ConfigError(
            f"fsdp=true: {type(model).__name__} has no decoder `layers` list to shard layer by "
            "layer; use deepspeed=zero2 or fsdp=false"
        )
    return list(layers)


def shard_model(model: Any, mixed_precision: str, device: torch.device) -> Any:
    """`model` sharded in place (each decoder layer, then the root) over every process; returns
    it. `mixed_precision` bf16: the layers compute in bf16 and reduce gradients in fp32 (the
    sharded master weights stay fp32)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def is_sharded(model: Any) -> bool:
    """Whether `model` was sharded by `shard_model` (FSDP2 changes its class in place)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def clip_grad_norm(params: Any, max_norm: float) -> float:
    """Clip the sharded gradients to a global norm `max_norm`; the norm before clipping. The
    norm of DTensor shards is a DTensor: its full value is one all-reduce."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": opt_sd}


def save_sharded(model: Any, opt: Any, folder: Path) -> None:
    """Collective: every process writes its shards of the model and optimizer under
    `folder/fsdp`."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt), checkpoint_id=str(Path(folder) / SHARDS_DIR))


def load_sharded(model: Any, opt: Any, folder: Path) -> None:
    """Collective: the model's and optimizer's shards read back in place from `folder/fsdp`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    shards = Path(folder) / SHARDS_DIR
    if not (shards / ".metadata").is_file():
        raise ConfigError(
            f"resume checkpoint {folder} has no FSDP shards ({shards}/.metadata): it was saved "
            "without fsdp=true, or the save was cut short; delete that folder and rerun"
        )
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=str(shards))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict on the main process (on CPU), {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


class FSDP2:
    """FSDP2 (train/spread.py, this module's docstring): sharded in place before the optimizer
    sees the parameters, never passed through `accelerator.prepare`; gradients reduce-scattered
    every micro-batch (averaged over processes, as DDP's); its own sharded checkpoints."""

    lockstep = True
    head_outside = True  # the root group (the head) stays whole from forward to backward
    holds_whole_model = False

    def make_accelerator(self, cfg: DictConfig, cuda: bool, kwargs: dict[str, Any]) -> Accelerator:
        from accelerate import Accelerator

        return Accelerator(**kwargs)

    def before_load(self, cuda: bool) -> None:
        ensure_process_group(cuda)

    def shard(self, drafter: torch.nn.Module, accelerator: Accelerator) -> None:
        shard_model(drafter, accelerator.mixed_precision, accelerator.device)

    def wrap(
        self, drafter: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Accelerator
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """As they are: accelerate would wrap DDP around them; their checkpoints are ours."""
        return drafter, opt

    def loss_scale(self, world: int, grad_accum: int) -> int:
        return world

    def boundary(
        self, accelerator: Accelerator, model: torch.nn.Module, a: int, grad_accum: int, step: int
    ) -> contextlib.AbstractContextManager[Any]:
        """Reduce-scattered every micro-batch: each rank keeps its shard of the window's sum."""
        return contextlib.nullcontext()

    def clip(
        self, accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None
    ) -> float | torch.Tensor | None:
        return None if max_norm is None else clip_grad_norm(model.parameters(), max_norm)

    def sharded(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        return model, opt
