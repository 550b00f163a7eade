"""One micro-batch's share of the window's loss, for a drafter that reads the target's ids.

p = target, q = drafter. The drafter's side is its logits at the loss positions only (the masked
head), its hidden states + head (`HeadInput`, for the fused chunked loss), the draft
vocabulary's head, or a parallel drafter's packed sequence (real tokens + mask chains); the
target's side is its live logits (no grad) or the stored top-k, gathered at the same positions.
The draft vocabulary's head is a vocabulary intersection (its K columns propose K target ids), so
its loss is intersection.py's `tli_loss` (treatment (b): the target's mass outside the subset is
an outcome q cannot produce), as for a drafter with its own tokenizer, which takes
`MappedPair.loss` instead (train/mapped.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specdistill.distill import parallel
from specdistill.distill.head_loss import HeadInput, fused_distill_loss, positions_per_chunk
from specdistill.distill.intersection import tli_loss
from specdistill.distill.losses import distill_loss
from specdistill.distill.train.logits import (
    causal_lm,
    has_plain_head,
    masked_head_input,
    masked_logits,
    model_inputs,
)

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer


def logits_and_targets(
    tr: Trainer, batch: dict[str, torch.Tensor], onp: bool, masked: bool
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


def packed_logits_and_targets(
    tr: Trainer, batch: dict[str, torch.Tensor], packed: dict[str, torch.Tensor], onp: bool,
    masked: bool,
) -> tuple[torch.Tensor | HeadInput, torch.Tensor, dict[str, Any]]:  # fmt: skip
    """drafting=parallel: the drafter's logits over the packed sequence (real tokens + mask
    chains), the target's figures gathered at each packed position's label, depth weights.

    `masked` (and the `token` objective, and a plain head): the head runs on the labelled
    positions only, as one [1, N] row (or as hidden states + head, `HeadInput`, with
    `tr.chunked`), like `logits_and_targets`; the packed grid's prompt, padding and unlabelled
    positions never reach the [.., V] logits. The acceptance-length objectives read each
    chain's soft acceptance on the packed grid, so they keep the full head.
    """
    objective = tr.s.parallel.objective  # type: ignore[union-attr]
    keep = None
    if masked and objective == "token" and has_plain_head(tr.model):
        keep = packed["weight"] > 0
    with tr.accelerator.autocast():
        if keep is None:
            logits = parallel.packed_forward(tr.model, packed)[..., : tr.vocab]
        else:
            hidden = parallel.packed_hidden(tr.model, packed)[keep]
            head = causal_lm(tr.model).get_output_embeddings()
            if tr.chunked:
                bias = None if head.bias is None else head.bias[: tr.vocab]
                logits = HeadInput(hidden, head.weight[: tr.vocab], bias)
            else:
                logits = head(hidden)[..., : tr.vocab][None]
    if tr.topk and not onp:
        kwargs: dict[str, Any] = {"topk_ids": batch["topk_ids"], "topk_lp": batch["topk_lp"]}
    else:
        with torch.no_grad():
            kwargs = {
                "target_logits": tr.target(  # type: ignore[misc]
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits[..., : tr.vocab]
            }
    kwargs = {k: parallel.gather_positions(v, packed["label_pos"]) for k, v in kwargs.items()}
    kwargs["weights"] = packed["weight"]
    miss_weight = tr.s.parallel.miss_weight  # type: ignore[union-attr]
    factors = None
    if miss_weight != 1.0:  # contexts just after a drafter miss, where rounds start
        drafter_top = _packed_argmax(logits, keep, packed["weight"].shape)
        factors = parallel.after_miss_factors(
            packed, drafter_top, parallel.target_argmax(kwargs), miss_weight
        )
        kwargs["weights"] = parallel.reweigh(packed["weight"], factors)
    if keep is not None:  # the labelled positions only, in the order `hidden[keep]` took them
        kwargs = {k: v[keep][None] for k, v in kwargs.items()}
        return logits, torch.ones_like(kwargs["weights"], dtype=torch.bool), kwargs
    if objective != "token":  # weights (and -E) from the drafter's own soft acceptance
        s = tr.eval_sampling  # the serving mode: greedy target or sampling at its temperature
        accept = parallel.packed_acceptance(logits, kwargs, s.greedy, float(s.temperature or 1))
        mix = tr.s.parallel.cat_mix  # type: ignore[union-attr]
        kwargs["weights"] = parallel.objective_weights(accept.detach(), packed, mix)
        if factors is not None:
            kwargs["weights"] = parallel.reweigh(kwargs["weights"], factors)
        if objective == "acceptance_length":
            kwargs["length_sum"] = parallel.chains_expected_length(accept, packed)
    return logits, packed["weight"] > 0, kwargs


@torch.no_grad()
def _packed_argmax(
    logits: torch.Tensor | HeadInput, keep: torch.Tensor | None, shape: torch.Size
) -> torch.Tensor:
    """(B, N) the drafter's argmax at each packed position (-1 where the masked head skipped
    it): from the full logits, or the kept positions' row (a `HeadInput` in the fused loss's
    chunks of rows, so no more than one chunk's logits exist at once)."""
    if keep is None:
        return logits.argmax(-1)  # type: ignore[union-attr]
    if isinstance(logits, HeadInput):
        n = logits.hidden.reshape(-1, logits.hidden.shape[-1]).shape[0]
        step = positions_per_chunk(logits.weight.shape[0], n)
        top = torch.cat([logits.logits(slice(i, i + step)).argmax(-1) for i in range(0, n, step)])
    else:
        top = logits[0].argmax(-1)
    out = torch.full(shape, -1, dtype=torch.long, device=top.device)
    out[keep] = top
    return out


def shared_vocab_loss(
    tr: Trainer, batch: dict, packed: dict | None, onp: bool, masked: bool, loss_name: str,
    beta: float, num_tokens: float, n_chains: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """One micro-batch's share of the window's loss when the drafter reads the target's ids
    (a parallel drafter with `parallel.objective=acceptance_length` also maximises the expected
    accepted length per mask chain of the window)."""
    if packed is None:
        logits, mask, kwargs = logits_and_targets(tr, batch, onp, masked)
    else:
        logits, mask, kwargs = packed_logits_and_targets(tr, batch, packed, onp, masked)
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
    length_sum = kwargs.pop("length_sum", None)  # parallel.objective=acceptance_length
    fused = isinstance(logits, HeadInput)
    loss = (fused_distill_loss if fused else distill_loss)(
        logits,  # type: ignore[arg-type]
        mask,
        divergence=loss_name,
        beta=beta,
        temperature=tr.s.loss.temperature,
        num_tokens=num_tokens,
        chunk_size=None if fused else tr.s.loss_chunk_size,
        **kwargs,
    )
    if length_sum is not None:  # maximise E[accepted] per chain of the window
        w_len = tr.s.parallel.length_weight  # type: ignore[union-attr]
        loss = loss - w_len * length_sum / max(n_chains, 1)
    return loss
