"""Drafter updates from the replay buffer: the top-k loss, optimizer steps and rollback.

The drafter q re-reads each sampled request (prompt + emitted tokens, one teacher-forced
forward) and is trained at the kept positions towards the target p's stored top-k with a
divergence of `specdistill.distill.losses` in its (K+1)-way form, which equals the full-vocab
loss when K = V (tested). Every random draw is seeded from (seed, update index), so a resumed
run repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.pairs import match_vocab
from specdistill.distill.losses import distill_loss
from specdistill.distill.online_buffer import Entry, ReplayBuffer
from specdistill.distill.train import _schedule


def buffer_batch(entries: list[Entry], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded ids (b, L), their mask, and the (row, position) of every kept position."""
    width = max(len(e.ids) for e in entries)
    ids = torch.full((len(entries), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(entries), width), dtype=torch.long)
    for i, e in enumerate(entries):
        ids[i, : len(e.ids)] = e.ids.long()
        mask[i, : len(e.ids)] = 1
    rows = torch.cat([torch.full((e.tokens,), i, dtype=torch.long) for i, e in enumerate(entries)])
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "rows": rows.to(device),
        "cols": torch.cat([e.positions for e in entries]).to(device),
        "topk_ids": torch.cat([e.topk_ids for e in entries]).long().to(device),
        "topk_lp": torch.cat([e.topk_lp for e in entries]).to(device),
    }


def buffer_loss(
    drafter, entries: list[Entry], *, vocab: int, loss: Any, pad_id: int, chunk: int | None = 256
) -> torch.Tensor:
    """Mean top-k divergence D(p || q) over the kept positions of `entries` (q = drafter)."""
    device = next(drafter.parameters()).device
    b = buffer_batch(entries, pad_id, device)
    logits = drafter(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    student = match_vocab(logits[b["rows"], b["cols"]], vocab)[None]  # (1, N, V)
    return distill_loss(
        student,
        torch.ones(student.shape[:2], dtype=torch.bool, device=device),
        topk_ids=b["topk_ids"][None],
        topk_lp=b["topk_lp"][None],
        divergence=str(loss.name),
        beta=float(loss.beta),
        chunk_size=chunk,
    )


class Updater:
    """The drafter's optimizer and LR schedule (the `optim` group), stepping on the buffer."""

    def __init__(self, drafter, cfg: DictConfig, total_steps: int, vocab: int, pad_id: int):
        self.drafter, self.cfg, self.vocab, self.pad_id = drafter, cfg, vocab, pad_id
        self.opt = hydra.utils.instantiate(cfg.optim.optimizer)(drafter.parameters())
        view = OmegaConf.create({"optim": cfg.optim, "max_steps": max(1, total_steps)})
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(view))

    def update(self, buffer: ReplayBuffer, update_index: int) -> list[float]:
        """`update_steps` optimizer steps on minibatches drawn from the buffer; their losses."""
        gen = torch.Generator().manual_seed(int(self.cfg.seed) * 1_000_003 + update_index)
        losses = []
        self.drafter.train()
        for _ in range(int(self.cfg.update_steps)):
            batch = buffer.sample(int(self.cfg.update_batch), gen)
            if not batch:
                break
            loss = buffer_loss(
                self.drafter,
                batch,
                vocab=self.vocab,
                loss=self.cfg.loss,
                pad_id=self.pad_id,
                chunk=self.cfg.loss_chunk_size,
            )
            loss.backward()
            if self.cfg.optim.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    self.drafter.parameters(), float(self.cfg.optim.max_grad_norm)
                )
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        self.drafter.eval()
        return losses

    def state_dict(self) -> dict:
        return {
            "drafter": {k: v.detach().clone() for k, v in self.drafter.state_dict().items()},
            "optimizer": copy.deepcopy(self.opt.state_dict()),
            "scheduler": self.sched.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore weights, optimizer and schedule (a rollback or a resume)."""
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.sched.load_state_dict(state["scheduler"])
