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
from omegaconf import DictConfig

from specdistill.data.models.pairs import match_vocab
from specdistill.data.runtime import pad_rows
from specdistill.distill.losses import distill_loss
from specdistill.distill.online.buffer import Entry, ReplayBuffer
from specdistill.distill.online.config import OnlineSettings
from specdistill.distill.train.lr_schedule import lr_schedule


def buffer_batch(entries: list[Entry], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded ids (b, L), their mask, and the (row, position) of every kept position."""
    ids, mask = pad_rows([e.ids for e in entries], pad_id, side="right")
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
    drafter,
    entries: list[Entry],
    *,
    vocab: int,
    loss: Any,
    pad_id: int,
    chunk: int | None = 256,
    anchor=None,
    anchor_kl: float = 0.0,
) -> torch.Tensor:
    """Mean top-k divergence D(p || q) over the kept positions of `entries` (q = drafter), plus
    `anchor_kl` * KL(q0 || q) there when an `anchor` drafter q0 (the starting one) is given.

    The anchor is a trust region in output space: the buffer holds a few requests, and without
    it the updates fit their noise and move q where it was already right (toy, greedy: the
    distilled drafter fell from 0.88 to 0.81 alpha on its own domain). With fkl it is exact
    interpolation: FKL(p||q) + w KL(q0||q) = (1 + w) KL(m||q) + const, m = (p + w q0) / (1 + w),
    so q is distilled towards a mixture of the target and its own starting point.
    """
    device = next(drafter.parameters()).device
    b = buffer_batch(entries, pad_id, device)
    logits = drafter(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    student = match_vocab(logits[b["rows"], b["cols"]], vocab)[None]  # (1, N, V)
    mask = torch.ones(student.shape[:2], dtype=torch.bool, device=device)
    value = distill_loss(
        student,
        mask,
        topk_ids=b["topk_ids"][None],
        topk_lp=b["topk_lp"][None],
        divergence=str(loss.name),
        beta=float(loss.beta),
        chunk_size=chunk,
    )
    if anchor is not None and anchor_kl > 0:
        value = value + anchor_kl * anchor_loss(anchor, student, mask, b, vocab, chunk)
    return value


def anchor_loss(
    anchor, student: torch.Tensor, mask: torch.Tensor, batch: dict, vocab: int, chunk: int | None
):
    """KL(q0 || q) averaged over the batch's kept positions, q0 = `anchor` (no gradient)."""
    with torch.no_grad():
        logits = anchor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        start = match_vocab(logits.logits[batch["rows"], batch["cols"]], vocab)[None]
    return distill_loss(student, mask, target_logits=start, divergence="fkl", chunk_size=chunk)


def gradient_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine between two gradients (lists of per-parameter tensors), over all parameters.

    The gate's signal: gradients of two disjoint sets of served requests point the same way
    when the traffic holds something the drafter has not learnt (a shift), and in unrelated
    directions when it is already at its optimum there, so that a step only fits noise. Toy
    pair, distilled drafter, greedy, 4 vs 4 requests: cos -0.10..0.25 on its own domain,
    0.46..0.94 on e-mail and numeric tables. Adam normalises step sizes, so a noise gradient
    moves the weights as far as a real one: the cosine, not the gradient norm, tells them apart.
    """
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na = sum(float(x.double().pow(2).sum()) for x in a) ** 0.5
    nb = sum(float(y.double().pow(2).sum()) for y in b) ** 0.5
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


class Updater:
    """The drafter's optimizer and LR schedule (the `optim` group), stepping on the buffer."""

    def __init__(
        self,
        drafter,
        cfg: DictConfig,
        total_steps: int,
        vocab: int,
        pad_id: int,
        anchor=None,
        settings: OnlineSettings | None = None,
    ):
        """`cfg`: the online config (its `optim` and `loss` nodes); `settings`: the rest, typed
        (built from `cfg` when not given); `anchor`: the starting drafter q0 for the `anchor_kl`
        trust region (frozen)."""
        self.drafter, self.cfg, self.vocab, self.pad_id = drafter, cfg, vocab, pad_id
        self.s = settings or OnlineSettings.from_cfg(cfg)
        self.anchor_kl = self.s.anchor_kl
        if self.anchor_kl > 0 and anchor is None:
            anchor = copy.deepcopy(drafter).requires_grad_(False)
        self.anchor = anchor.eval() if anchor is not None and self.anchor_kl > 0 else None
        self.opt = hydra.utils.instantiate(cfg.optim.optimizer)(drafter.parameters())
        schedule = lr_schedule(cfg.optim, max(1, total_steps))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.gated = 0  # optimizer steps skipped by the agreement gate
        self.agreements: list[float] = []  # the gate's cosines, drained by the serving loop

    def _loss(self, batch: list[Entry]) -> torch.Tensor:
        return buffer_loss(
            self.drafter,
            batch,
            vocab=self.vocab,
            loss=self.cfg.loss,
            pad_id=self.pad_id,
            chunk=self.s.loss_chunk_size,
            anchor=self.anchor,
            anchor_kl=self.anchor_kl,
        )

    def _step(self) -> None:
        if self.cfg.optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                self.drafter.parameters(), float(self.cfg.optim.max_grad_norm)
            )
        self.opt.step()
        self.sched.step()

    def update(self, buffer: ReplayBuffer, update_index: int, relaxed: bool = False) -> list[float]:
        """`update_steps` optimizer steps on minibatches drawn from the buffer; their losses.

        With `gate_agreement: G`, each step draws two disjoint half-batches of requests and
        steps on their mean gradient only if the two gradients agree, cos >= G; `self.gated`
        counts the skipped steps (see `gradient_agreement`). `relaxed` (a detected shift, see
        `specdistill.distill.online.drift`): the threshold is `gate_relaxed` instead (never
        stricter than G; null: no gate).
        """
        gen = torch.Generator().manual_seed(self.s.seed * 1_000_003 + update_index)
        gate = self.s.gate
        if relaxed and gate is not None:
            loose = self.s.gate_relaxed
            gate = None if loose is None else min(gate, float(loose))
        losses = []
        self.drafter.train()
        for _ in range(self.s.update_steps):
            if gate is None:
                batch = buffer.sample(self.s.update_batch, gen)
                if not batch:
                    break
                loss = self._loss(batch)
                loss.backward()
                self._step()
                losses.append(float(loss.detach()))
            else:
                halves = buffer.sample_halves(self.s.update_batch, gen)
                if halves is None:
                    break
                grads, pair = [], []
                for half in halves:
                    loss = self._loss(half)
                    loss.backward()
                    grads.append([p.grad.detach().clone() for p in self._params()])
                    pair.append(float(loss.detach()))
                    self.opt.zero_grad(set_to_none=True)
                losses.append(sum(pair) / 2)
                cos = gradient_agreement(*grads)
                self.agreements.append(cos)
                if cos < float(gate):
                    self.gated += 1
                    continue
                for p, a, b in zip(self._params(), *grads):
                    p.grad = (a + b) / 2
                self._step()
            self.opt.zero_grad(set_to_none=True)
        self.drafter.eval()
        return losses

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

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
