"""One micro-batch's share of the window's loss, for a drafter that reads the target's ids.

p = target, q = drafter. The drafter's side is its logits at the loss positions only (the masked
head), its hidden states + head (`HeadInput`, for the fused chunked loss), the draft
vocabulary's head; the
target's side is its live logits (no grad) or the stored top-k, gathered at the same positions.
The draft vocabulary's head is a vocabulary intersection (its K columns propose K target ids), so
its loss is intersection.py's `tli_loss` (treatment (b): the target's mass outside the subset is
an outcome q cannot produce), as for a drafter with its own tokenizer, which takes
`MappedPair.loss` instead (train/mapped_vocab.py). A parallel drafter's packed sequence is
train/parallel_drafting.py's; it shares `divergence_loss`. `SharedVocab` is this objective as a
part of the run (train/objective.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdistill.decode.draft_vocab import CONFIG_KEY
from specdistill.distill.head_loss import HeadInput, fused_distill_loss
from specdistill.distill.intersection import Intersection, tli_loss
from specdistill.distill.losses import distill_loss
from specdistill.distill.train import setup
from specdistill.distill.train.evaluate import evaluate
from specdistill.distill.train.logits import (
    has_plain_head,
    masked_head_input,
    masked_logits,
    model_inputs,
)
from specdistill.distill.train.objective import TokenObjective, TrainingRun

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdistill.data.models.pairs import PairSpec
    from specdistill.distill.train.example import Example
    from specdistill.distill.train.settings import TrainSettings


def logits_and_targets(
    tr: TrainingRun, batch: dict[str, torch.Tensor], onp: bool, masked: bool
) -> tuple[torch.Tensor | HeadInput, torch.Tensor, dict[str, Any]]:
    """(drafter logits, loss mask, the target's keywords for the loss) of one micro-batch.

    `masked`: logits of the loss positions only, as one [1, N, V] row (`logits.masked_logits`),
    and the target's logits or stored top-k gathered at the same positions; else the padded
    [b, n, V] grid. The loss is a sum over positions, so both give the same value. With
    `tr.chunked` (and a plain head) the drafter comes as hidden states + head (`HeadInput`,
    for `fused_distill_loss`), and so does a live target with a plain head. With the draft
    vocabulary's head (`tr.head_ids`) the logits are its [1, N, K] columns and the stored top-k
    ids come as `topk_rows` (those columns, -1 outside the subset) for `intersection.tli_loss`.
    """
    ids, mask = batch["input_ids"], batch["loss_mask"]
    # a packed batch (train/packing.py) has position ids and no attention mask
    att, pos = batch.get("attention_mask"), batch.get("position_ids")
    use_topk = tr.topk and not onp
    sub = masked and use_topk and tr.head_ids is not None  # the draft vocabulary's head only
    fused = masked and not sub and tr.chunked and has_plain_head(tr.model)
    with tr.accelerator.autocast():
        if fused:
            logits = masked_head_input(tr.model, ids, att, mask, tr.vocab, pos)
        elif masked:
            head = tr.head_ids if sub else None
            logits = masked_logits(tr.model, ids, att, mask, tr.vocab, head, pos)[None]
        else:
            logits = tr.model(**model_inputs(ids, att, pos)).logits[..., : tr.vocab]
    if use_topk:
        kwargs: dict[str, Any] = {"topk_ids": batch["topk_ids"], "topk_lp": batch["topk_lp"]}
        if masked:
            kwargs = {k: v[mask][None] for k, v in kwargs.items()}
        if sub:  # the target's top-k ids as the subset's columns (-1: q never proposes it)
            served = tr.head_inter.served_row  # type: ignore[union-attr]
            kwargs["topk_rows"] = served[kwargs.pop("topk_ids").long()]
    else:
        with torch.no_grad():
            if fused and has_plain_head(tr.target):
                target = masked_head_input(tr.target, ids, att, mask, tr.vocab, pos)
            elif masked:
                target = masked_logits(tr.target, ids, att, mask, tr.vocab, None, pos)[None]
            else:
                target = tr.target(**model_inputs(ids, att, pos)).logits[..., : tr.vocab]
        kwargs = {"target_logits": target}
    if masked:
        rows = logits.hidden.shape[:1] if fused else logits.shape[:2]  # type: ignore[union-attr]
        mask = torch.ones(rows, dtype=torch.bool, device=ids.device)
    return logits, mask, kwargs


def shared_vocab_loss(
    tr: TrainingRun, batch: dict, onp: bool, masked: bool, loss_name: str, beta: float,
    num_tokens: float,
) -> torch.Tensor:  # fmt: skip
    """One micro-batch's share of the window's loss when the drafter reads the target's ids."""
    logits, mask, kwargs = logits_and_targets(tr, batch, onp, masked)
    if "topk_rows" in kwargs:  # the draft vocabulary's head: treatment (b), greedy mask as set
        return tli_loss(
            logits,  # type: ignore[arg-type]
            mask,
            tr.head_inter,  # type: ignore[arg-type]
            divergence=loss_name,
            beta=beta,
            temperature=tr.s.loss.temperature,
            num_tokens=num_tokens,
            mask_unreachable=tr.s.mask_unreachable,
            chunk_size=tr.s.loss_chunk_size,
            **kwargs,
        )
    return divergence_loss(tr, logits, mask, kwargs, loss_name, beta, num_tokens)


def divergence_loss(
    tr: TrainingRun, logits: torch.Tensor | HeadInput, mask: torch.Tensor, kwargs: dict[str, Any],
    loss_name: str, beta: float, num_tokens: float,
) -> torch.Tensor:  # fmt: skip
    """The divergence summed over the loss positions / `num_tokens`: from the logits, or fused
    from hidden states + head (`HeadInput`, never the [N, V] logits)."""
    fused = isinstance(logits, HeadInput)
    return (fused_distill_loss if fused else distill_loss)(
        logits,  # type: ignore[arg-type]
        mask,
        divergence=loss_name,
        beta=beta,
        temperature=tr.s.loss.temperature,
        num_tokens=num_tokens,
        chunk_size=None if fused else tr.s.loss_chunk_size,
        **kwargs,
    )


def train_head_ids(
    s: TrainSettings, drafter: PreTrainedModel, topk: bool, device: Any
) -> tuple[torch.Tensor | None, Intersection | None]:
    """(ids [K], the draft vocabulary as an `Intersection` over K head columns) when the drafter
    trains on its draft vocabulary (`draft_vocab_train=true`): the loss then sees q over the
    subset, the distribution our decoder drafts from, and the head's matmul and gradient shrink
    by V / K.

    A draft vocabulary is a vocabulary intersection (column j proposes target id ids[j]), so the
    loss is intersection.py's treatment (b): the target's stored top-k mass outside the subset
    goes to an outcome q cannot produce, not into the top-k loss's rest bucket, where q would be
    asked to match it with mass on in-vocabulary tokens off the top-k; TVD then reads as 1 - the
    acceptance our decoder serves (exactly when the top-k tail is empty), and greedy serving
    drops positions whose stored top-1 is outside (`tli_mask_unreachable`).

    `auto` (the default) turns it on for big heads only (`TrainSettings.trains_draft_vocab`):
    logits outside the subset are never trained down, so the export pads the head for engines
    that run all of it (export/head.py). Only stored top-k rows use it; live logits keep the
    full head."""
    ids = getattr(drafter.config, CONFIG_KEY, None)
    rows = drafter.get_output_embeddings().weight.shape[0]
    if not s.trains_draft_vocab(rows) or not ids or not topk:
        return None, None
    head_ids = torch.tensor(ids, dtype=torch.long)
    inter = Intersection.from_draft_to_target(head_ids, rows)
    return head_ids.to(device), inter.to(device)


class SharedVocab(TokenObjective):
    """The drafter reads the target's ids (train/objective.py): the loss on the target's live
    logits or stored top-k, over the full head or the draft vocabulary's columns."""

    def load_target(
        self, spec: PairSpec, device: Any, drafter: PreTrainedModel, tok: PreTrainedTokenizerBase
    ) -> PreTrainedModel:
        return setup.load_target(spec, self.s, device, drafter, tok)

    def store_draft_vocab(
        self, drafter: PreTrainedModel, rows: Sequence[Example], tok: PreTrainedTokenizerBase
    ) -> None:
        setup.set_draft_vocab(self.s.draft_vocab, drafter, rows, tok, None)

    def train_head(
        self, drafter: PreTrainedModel, topk: bool, device: Any
    ) -> tuple[torch.Tensor | None, Intersection | None]:
        return train_head_ids(self.s, drafter, topk, device)

    def loss(
        self, tr: TrainingRun, batch: dict[str, Any], onp: bool, masked: bool, divergence: str,
        beta: float, num_tokens: float, n_chains: float,
    ) -> torch.Tensor:  # fmt: skip
        return shared_vocab_loss(tr, batch, onp, masked, divergence, beta, num_tokens)

    def evaluate(self, tr: TrainingRun) -> dict[str, Any]:
        return evaluate(
            tr.accelerator.unwrap_model(tr.model),
            tr.target,
            tr.eval_batches,
            vocab=tr.vocab,
            sampling=tr.eval_sampling,
            device=tr.device,
            head_ids=tr.head_ids,
        )
