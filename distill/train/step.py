"""One optimizer step of the distill stage: this process's micro-batches of the accumulation
window, the loss normalised by the window's tokens across processes, backward, clip, step.

The loss is summed over completion tokens and divided by the token count of the whole window
across processes (the root DESIGN.md, "GKD naming"), so 2 processes x 1 micro-batch train
exactly like 1 process x 2. Micro-batch g's rows and whether it is on-policy follow from
(seed, g) alone (train/data.py `StreamSpec`), so a resumed run sees exactly the batches an
uninterrupted one would.

One path for every mode: the run's objective (train/objective.py) prepares each micro-batch,
gives the window's normaliser and each micro-batch's loss; its spread (train/spread.py) says
where the accumulation boundary falls, how the loss is scaled and how gradients are clipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specdistill.distill.train.data import (
    StreamSpec,
    collate,
    is_onpolicy,
    micro_seed,
)
from specdistill.distill.train.objective import Window
from specdistill.distill.train.onpolicy import sample_onpolicy
from specdistill.distill.train.packing import collate_packed

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer


def any_rank_onpolicy(stream: StreamSpec, step: int, a: int, seed: int, lmbda: float) -> bool:
    """Whether any rank's micro-batch at (step, accumulation index a) is drafter-generated."""
    return any(
        is_onpolicy(seed, stream.global_micro_index(step, a, r), lmbda)
        for r in range(stream.world_size)
    )


def micro_batches(tr: Trainer, step: int, lmbda: float) -> Window:
    """This process's micro-batches of one optimizer step, each flagged on-policy or not."""
    s, seed = tr.s, tr.s.seed
    lockstep = tr.spread.lockstep  # ZeRO-3 / FSDP2: a forward gathers shards from every rank
    rank = tr.accelerator.process_index
    window = []
    for a in range(s.grad_accum):
        g = tr.stream.global_micro_index(step, a, rank)
        exs = [tr.train_examples[i] for i in tr.stream.indices(g)]
        onp = is_onpolicy(seed, g, lmbda)
        how = dict(
            pad_id=tr.tok.pad_token_id,
            eos_id=tr.tok.eos_token_id,
            max_new_tokens=s.onpolicy.max_new_tokens,
            sampling=tr.onpolicy_sampling,
            seed=micro_seed(seed, g),
        )
        drafter = tr.accelerator.unwrap_model(tr.model)
        # in lockstep, when any rank of this slot is on-policy all of them generate together
        # (and the others drop their samples)
        if onp and tr.rollouts is not None:  # the drafter in vLLM (train/rollouts.py)
            exs = tr.rollouts.sample(drafter, step, exs, **how)
        elif onp or (lockstep and any_rank_onpolicy(tr.stream, step, a, seed, lmbda)):
            sampled = sample_onpolicy(drafter, exs, **how, synced_gpus=lockstep)
            exs = sampled if onp else exs
        # drafter samples are collated padded; Seq-KD rows packed when asked (train/packing.py)
        if s.pack_sequences and not onp:
            batch = collate_packed(exs, tr.tok.pad_token_id, s.max_seq_len, tr.pack_one_row)
        else:
            batch = collate(exs, tr.tok.pad_token_id, s.max_seq_len)
        window.append((tr.objective.prepare_batch(batch, seed, g), onp))
    return window


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A micro-batch's tensors (and a nested section's, such as parallel chains) on `device`."""
    return {
        k: _to_device(v, device) if isinstance(v, dict) else v.to(device) for k, v in batch.items()
    }


def train_step(tr: Trainer, step: int) -> dict[str, Any]:
    """One optimizer step over the accumulation window; its log record (without eval)."""
    s, accelerator, model, device = tr.s, tr.accelerator, tr.model, tr.device
    loss_name, beta, lmbda = s.phase_at(step)  # a `switch` changes them mid-run
    window = micro_batches(tr, step, lmbda)
    A = s.grad_accum
    n_local = sum(int(b["loss_mask"].sum()) for b, _ in window)
    n_tokens = int(accelerator.reduce(torch.tensor(n_local, device=device), "sum"))

    def reduce(x: float) -> torch.Tensor:
        return accelerator.reduce(torch.tensor(x, device=device), "sum")

    n_window, n_chains = tr.objective.normalisers(window, reduce, n_tokens)
    # the spread's own averaging undone, so the gradient is exactly sum(token losses) / n_window
    scale = tr.spread.loss_scale(accelerator.num_processes, A)
    loss_sum = torch.zeros((), device=device)
    # The head only at loss positions (so the chunked loss and the draft vocabulary's head)
    # wherever the spread keeps its weight whole outside the forward (train/logits.py).
    masked = s.masked_head and tr.spread.head_outside
    for a, (batch, onp) in enumerate(window):
        batch = _to_device(batch, device)
        with tr.spread.boundary(accelerator, model, a, A, step):
            loss = tr.objective.loss(
                tr, batch, onp, masked, loss_name, beta, max(n_window, 1), n_chains
            )
            accelerator.backward(loss * scale)
        loss_sum += loss.detach()
    grad_norm = tr.spread.clip(accelerator, model, tr.cfg.optim.max_grad_norm)
    tr.opt.step()
    tr.sched.step()
    tr.opt.zero_grad(set_to_none=True)
    rec = {
        "step": step + 1,
        "loss": float(accelerator.reduce(loss_sum, "sum")),
        "lr": tr.sched.get_last_lr()[0],
        "tokens": n_tokens,
    }
    if grad_norm is not None:
        rec["grad_norm"] = float(grad_norm)
    return rec
