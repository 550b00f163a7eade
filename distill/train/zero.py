"""DeepSpeed ZeRO-2/3 for the distill stage, on GPUs and on CPU (gloo).

accelerate 1.15 only builds a DeepSpeed engine when `Accelerator(cpu=False)`, and on a machine
without CUDA it then finds no distributed backend: it lets DeepSpeed create a gloo process
group but reports `num_processes` 1 and `process_index` 0 on every rank, so each rank would
think it is alone. Naming the backend (`InitProcessGroupKwargs(backend="gloo")`) makes it read
rank and world size from that process group. `check_ranks` then refuses any launch whose
ranks disagree with the launcher's RANK/WORLD_SIZE, rather than train on duplicated data.

The DeepSpeed config is written in full here (micro batch, accumulation, clipping, batch size
all explicit) so no "auto" value depends on a dataloader the stage does not prepare.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

OFFLOAD_DEVICES = ("none", "cpu")


def zero_stage(cfg: DictConfig) -> int:
    """0 when DeepSpeed is off."""
    if not cfg.deepspeed.enabled:
        return 0
    return int(OmegaConf.select(cfg, "deepspeed.config.zero_optimization.stage", default=0))


def check_deepspeed(cfg: DictConfig, cuda: bool) -> None:
    """Reject DeepSpeed settings that cannot run here, naming the field (before any model)."""
    if not cfg.deepspeed.enabled:
        return
    stage = zero_stage(cfg)
    if stage not in (2, 3):
        raise ConfigError(
            f"deepspeed.config.zero_optimization.stage={stage}: use deepspeed=zero2 or zero3"
        )
    for field in ("offload_optimizer", "offload_param"):
        dev = str(cfg.deepspeed[field])
        if dev not in OFFLOAD_DEVICES:
            raise ConfigError(
                f"deepspeed.{field}={dev}: use none or cpu (NVMe offload needs an aio build and a "
                "path: set it in deepspeed.config.zero_optimization instead)"
            )
    if str(cfg.deepspeed.offload_param) != "none" and stage != 3:
        raise ConfigError("deepspeed.offload_param=cpu needs ZeRO-3: use deepspeed=zero3")
    if "optimizer" in (cfg.deepspeed.config or {}):
        raise ConfigError(
            "deepspeed.config.optimizer is set: the stage builds its optimizer from optim.* "
            "(so the LR schedule drives it); remove deepspeed.config.optimizer"
        )
    if not cuda and cfg.mixed_precision == "fp16":
        raise ConfigError("mixed_precision=fp16 with DeepSpeed needs a CUDA GPU: use no or bf16")
    if not cuda and os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        raise ConfigError(
            f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} but the stage runs on CPU "
            "(device=cpu or no CUDA): unset DS_ACCELERATOR or set it to cpu"
        )


def ds_config(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config with every batch/accumulation/clipping value filled from cfg."""
    ds = OmegaConf.to_container(cfg.deepspeed.config, resolve=True)
    assert isinstance(ds, dict)
    mbs, accum = int(cfg.micro_batch_size), int(cfg.grad_accum)
    ds["train_micro_batch_size_per_gpu"] = mbs
    ds["gradient_accumulation_steps"] = accum
    ds["train_batch_size"] = mbs * accum * world_size
    clip = cfg.optim.max_grad_norm
    ds["gradient_clipping"] = float(clip) if clip is not None else 0.0  # 0: DeepSpeed skips it
    zero = ds.setdefault("zero_optimization", {})
    for field in ("offload_optimizer", "offload_param"):
        dev = str(cfg.deepspeed[field])
        if dev != "none":
            zero[field] = {"device": dev, "pin_memory": False}
    if str(cfg.deepspeed.offload_optimizer) != "none":
        # Keep the stage's torch optimizer (and the LR schedule on it) instead of swapping in
        # DeepSpeedCPUAdam, whose C++ op would have to be JIT-built on every machine.
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _launcher_world() -> tuple[int, int] | None:
    """(rank, world size) as the launcher set them, or None outside a launcher."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _single_process_env() -> None:
    """DeepSpeed always runs over a process group: give a lone process a world of one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)


def make_deepspeed_accelerator(cfg: DictConfig, cuda: bool, kwargs: dict[str, Any]):
    """An Accelerator driving a DeepSpeed engine, with real ranks on CPU as on GPU."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    if _launcher_world() is None:
        _single_process_env()
    rank, world = _launcher_world()  # type: ignore[misc]
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # even when a GPU is visible (device=cpu)
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    kwargs["cpu"] = False  # accelerate 1.15 never uses DeepSpeed with cpu=True
    kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
        hf_ds_config=ds_config(cfg, world),
        gradient_accumulation_steps=int(cfg.grad_accum),
        gradient_clipping=cfg.optim.max_grad_norm,
        zero3_init_flag=False,  # the frozen target is loaded after: it must stay whole
    )
    kwargs["gradient_accumulation_steps"] = int(cfg.grad_accum)
    accelerator = Accelerator(**kwargs)
    check_ranks(accelerator, rank, world)
    # accelerate registers its ZeRO-3 config with transformers even with zero3_init_flag=False,
    # and from_pretrained would then partition the frozen target too (which no engine gathers:
    # it would have 0-sized weights). Models load whole; deepspeed.initialize shards the drafter.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return accelerator


def check_ranks(accelerator, rank: int, world: int) -> None:
    """Refuse a run whose DeepSpeed ranks disagree with the launcher's (duplicated data)."""
    from accelerate.utils import DistributedType

    seen = {
        "distributed_type": str(accelerator.distributed_type),
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "torch.distributed world": (
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
        ),
    }
    ok = (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.process_index == rank
        and accelerator.num_processes == world
        and seen["torch.distributed world"] == world
    )
    if not ok:
        raise ConfigError(
            f"deepspeed: the launcher started rank {rank} of {world} but accelerate/DeepSpeed "
            f"see {seen}: launch with `torchrun --nproc_per_node N` or "
            "`accelerate launch --use_deepspeed --num_processes N`, or use deepspeed=none"
        )


class ZeRO:
    """DeepSpeed ZeRO-2/3 (train/spread.py): the engine owns the accumulation boundary (its
    counter comes from accelerate's), divides the loss by its accumulation steps and clips at
    the boundary. ZeRO-3 partitions every weight, the head's included: its forwards gather
    shards from every rank (so they run in lockstep) and the head runs inside the forward."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.lockstep = stage == 3
        self.head_outside = stage != 3
        self.holds_whole_model = stage != 3

    def make_accelerator(self, cfg: DictConfig, cuda: bool, kwargs: dict[str, Any]) -> Accelerator:
        return make_deepspeed_accelerator(cfg, cuda, kwargs)

    def before_load(self, cuda: bool) -> None:
        """Nothing: the DeepSpeed accelerator started the process group."""

    def shard(self, drafter: torch.nn.Module, accelerator: Accelerator) -> None:
        """Nothing here: `deepspeed.initialize` (inside `accelerator.prepare`) partitions it."""

    def wrap(
        self, drafter: torch.nn.Module, opt: torch.optim.Optimizer, accelerator: Accelerator
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return accelerator.prepare(drafter, opt)

    def loss_scale(self, world: int, grad_accum: int) -> int:
        """The engine averages over processes and divides by its accumulation steps."""
        return world * grad_accum

    def boundary(
        self, accelerator: Accelerator, model: torch.nn.Module, a: int, grad_accum: int, step: int
    ) -> contextlib.AbstractContextManager[Any]:
        return _accumulating(accelerator, model, a == grad_accum - 1, step, a)

    def clip(
        self, accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None
    ) -> float | torch.Tensor | None:
        """The engine clipped (and stepped) at the boundary: its norm before clipping."""
        return accelerator.deepspeed_engine_wrapped.get_global_grad_norm()

    def sharded(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        return None


@contextlib.contextmanager
def _accumulating(
    accelerator: Accelerator, model: torch.nn.Module, last: bool, step: int, a: int
) -> Iterator[None]:
    """accelerate's accumulation context, checked to close the window where the loop does."""
    with accelerator.accumulate(model):
        if accelerator.sync_gradients != last:
            raise RuntimeError(f"DeepSpeed accumulation boundary out of step at {step}/{a}")
        yield
