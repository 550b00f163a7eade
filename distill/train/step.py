"""One optimizer step of the distill stage: this process's micro-batches of the accumulation
window, the loss normalised by the window's tokens across processes, backward, clip, step.

The loss is summed over completion tokens and divided by the token count of the whole window
across processes (the root DESIGN.md, "GKD naming"), so 2 processes x 1 micro-batch train
exactly like 1 process x 2. Micro-batch g's rows and whether it is on-policy follow from
(seed, g) alone (train/data.py `StreamSpec`), so a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from specdistill.distill import parallel
from specdistill.distill.train import fsdp, zero
from specdistill.distill.train.batch_loss import shared_vocab_loss
from specdistill.distill.train.data import collate, is_onpolicy, micro_seed, sample_onpolicy
from specdistill.distill.train.packing import collate_packed

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer


def micro_batches(tr: Trainer, step: int, lmbda: float) -> list[tuple[dict, bool]]:
    """This process's micro-batches of one optimizer step, each flagged on-policy or not."""
    s, seed = tr.s, tr.s.seed
    # ZeRO-3 and FSDP2: a forward gathers shards from every rank (so generation is in lockstep)
    lockstep = s.zero_stage == 3 or s.fsdp
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
        # ZeRO-3 / FSDP2: a forward gathers shards from every rank, so when any rank of this slot
        # is on-policy all of them generate together (and the others drop their samples).
        if onp and tr.rollouts is not None:  # the drafter in vLLM (train/rollouts.py)
            exs = tr.rollouts.sample(drafter, step, exs, **how)
        elif onp or (lockstep and zero.any_rank_onpolicy(tr.stream, step, a, seed, lmbda)):
            sampled = sample_onpolicy(drafter, exs, **how, synced_gpus=lockstep)
            exs = sampled if onp else exs
        # drafter samples are collated padded; Seq-KD rows packed when asked (train/packing.py)
        if s.pack_sequences and not onp:
            batch = collate_packed(exs, tr.tok.pad_token_id, s.max_seq_len, tr.pack_one_row)
        else:
            batch = collate(exs, tr.tok.pad_token_id, s.max_seq_len)
        if tr.mask_token_id is not None:  # mask chains appended, anchors drawn per micro-batch
            batch["packed"] = parallel.pack_batch(batch, s.parallel, tr.mask_token_id, seed, g)
        window.append((batch, onp))
    return window


def train_step(tr: Trainer, step: int) -> dict[str, Any]:
    """One optimizer step over the accumulation window; its log record (without eval)."""
    s, accelerator, model, device = tr.s, tr.accelerator, tr.model, tr.device
    loss_name, beta, lmbda = s.phase_at(step)  # a `switch` changes them mid-run
    window = micro_batches(tr, step, lmbda)
    A, world, ds_on = s.grad_accum, accelerator.num_processes, s.deepspeed
    n_local = sum(int(b["loss_mask"].sum()) for b, _ in window)
    n_tokens = n_window = int(accelerator.reduce(torch.tensor(n_local, device=device), "sum"))
    n_chains = 1.0
    if tr.mask_token_id is not None:  # the normaliser: the summed depth weights of all positions
        w_local = sum(float(b["packed"]["weight"].sum()) for b, _ in window)
        n_window = float(accelerator.reduce(torch.tensor(w_local, device=device), "sum"))
        c_local = sum(parallel.chain_count(b["packed"]) for b, _ in window)
        n_chains = float(accelerator.reduce(torch.tensor(c_local, device=device), "sum"))
    # DDP (and FSDP2's reduce-scatter) average gradients over processes and DeepSpeed divides
    # by its accumulation steps: undo both so the gradient is exactly sum(token losses) / n_window.
    scale = world * (A if ds_on else 1)
    loss_sum = torch.zeros((), device=device)
    # The head only at loss positions (so the chunked loss and the draft vocabulary's head):
    # the bare model, or a DDP / ZeRO-1/2 wrapper running its own forward without the head
    # (train/logits.final_hidden), or FSDP2, whose root group (the head) stays whole from the
    # forward to the backward. ZeRO-3 partitions the head's weight: the full forward there.
    masked = s.masked_head and s.zero_stage != 3
    for a, (batch, onp) in enumerate(window):
        packed = batch.pop("packed", None)
        batch = {k: v.to(device) for k, v in batch.items()}
        if packed is not None:
            packed = {k: v.to(device) for k, v in packed.items()}
        if ds_on:  # the engine's accumulation boundary comes from accelerate's counter
            boundary = accelerator.accumulate(model)
        elif s.fsdp:  # reduce-scattered every micro-batch: each rank keeps a shard (fsdp.py)
            boundary = contextlib.nullcontext()
        else:
            sync = a == A - 1
            boundary = contextlib.nullcontext() if sync else accelerator.no_sync(model)
        with boundary:
            if ds_on and accelerator.sync_gradients != (a == A - 1):
                raise RuntimeError(f"DeepSpeed accumulation boundary out of step at {step}/{a}")
            temperature = s.loss.temperature
            if tr.mapped is not None:  # another tokenizer: the TLI loss (train/mapped.py)
                loss = tr.mapped.loss(
                    tr, batch, masked, loss_name, beta, temperature, max(n_window, 1)
                )
            else:
                loss = shared_vocab_loss(
                    tr, batch, packed, onp, masked, loss_name, beta, max(n_window, 1), n_chains
                )
            accelerator.backward(loss * scale)
        loss_sum += loss.detach()
    grad_norm = None
    max_norm = tr.cfg.optim.max_grad_norm  # the optim group stays a node
    if max_norm is not None and s.fsdp:
        grad_norm = fsdp.clip_grad_norm(model.parameters(), max_norm)
    elif max_norm is not None and not ds_on:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    elif ds_on:  # the engine clipped (and stepped) at the boundary; its pre-clip norm
        grad_norm = accelerator.deepspeed_engine_wrapped.get_global_grad_norm()
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
