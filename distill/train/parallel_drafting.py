"""Parallel (PARD) drafting as the objective of a distill run (train/objective.py): one forward
drafts a whole round, so each micro-batch carries mask chains packed after its real tokens
(distill/parallel.py: anchors drawn from (seed, micro-batch), depth weights, a 4-D mask).

p = target, q = drafter. The drafter's side is its logits over the packed sequence (or, with
the masked head and the `token` objective, at the labelled positions only); the target's side
is its live logits or stored top-k gathered at each packed position's label. The window's loss
is divided by the summed depth weights of all its positions, across ranks; the acceptance-length
objectives also maximise the expected accepted drafts per mask chain. The held-out figure is
acceptance at every depth, and best/ follows the expected accepted drafts per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdistill.distill import parallel
from specdistill.distill.head_loss import HeadInput, positions_per_chunk
from specdistill.distill.train import mask_row, setup
from specdistill.distill.train.evaluate import evaluate_parallel
from specdistill.distill.train.logits import causal_lm, has_plain_head
from specdistill.distill.train.objective import TokenObjective, TrainingRun, Window
from specdistill.distill.train.settings import ParallelSettings, TrainSettings
from specdistill.distill.train.shared_vocab import divergence_loss

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdistill.data.models.pairs import PairSpec
    from specdistill.distill.train.example import Example


def packed_logits_and_targets(
    tr: TrainingRun, batch: dict[str, torch.Tensor], packed: dict[str, torch.Tensor], onp: bool,
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


def parallel_loss(
    tr: TrainingRun, batch: dict, packed: dict, onp: bool, masked: bool, loss_name: str,
    beta: float, num_tokens: float, n_chains: float,
) -> torch.Tensor:  # fmt: skip
    """One micro-batch's share of the window's loss (`parallel.objective=acceptance_length`
    also maximises the expected accepted length per mask chain of the window)."""
    logits, mask, kwargs = packed_logits_and_targets(tr, batch, packed, onp, masked)
    length_sum = kwargs.pop("length_sum", None)  # parallel.objective=acceptance_length
    loss = divergence_loss(tr, logits, mask, kwargs, loss_name, beta, num_tokens)
    if length_sum is not None:  # maximise E[accepted] per chain of the window
        w_len = tr.s.parallel.length_weight  # type: ignore[union-attr]
        loss = loss - w_len * length_sum / max(n_chains, 1)
    return loss


class ParallelDrafting(TokenObjective):
    """A PARD drafter (train/objective.py): mask chains packed per micro-batch, its mask token's
    embedding row trained alone when embeddings are frozen (train/mask_row.py), every depth
    evaluated against the target in the loop."""

    def __init__(self, s: TrainSettings) -> None:
        super().__init__(s)
        assert s.parallel is not None  # choose_parts picks this objective for drafting=parallel
        self.par: ParallelSettings = s.parallel
        self.mask_token_id = -1  # set once the tokenizer is known (`prepare_drafter`)

    def prepare_drafter(
        self, spec: PairSpec, tok: PreTrainedTokenizerBase, drafter: PreTrainedModel, device: Any
    ) -> None:
        self.mask_token_id = parallel.resolve_train_mask_token(self.par.mask_token_id, tok)
        parallel.prepare_drafter(drafter, self.mask_token_id, self.par.depth)

    def needs_target(self, train_topk: bool, eval_topk: bool) -> bool:
        """Always: every depth is evaluated against the target in the loop."""
        return True

    def load_target(
        self, spec: PairSpec, device: Any, drafter: PreTrainedModel, tok: PreTrainedTokenizerBase
    ) -> PreTrainedModel:
        return setup.load_target(spec, self.s, device, drafter, tok)

    def store_draft_vocab(
        self, drafter: PreTrainedModel, rows: Sequence[Example], tok: PreTrainedTokenizerBase
    ) -> None:
        setup.set_draft_vocab(self.s.draft_vocab, drafter, rows, tok, self.mask_token_id)

    def freeze_embeddings(self, drafter: PreTrainedModel) -> int:
        """Every row but the mask token's, which has no trained row yet (train/mask_row.py)."""
        return mask_row.train_mask_row_only(drafter, int(drafter.config.mask_token_id))

    def prepare_batch(self, batch: dict[str, Any], seed: int, g: int) -> dict[str, Any]:
        """Mask chains appended, anchors drawn per micro-batch."""
        batch["packed"] = parallel.pack_batch(batch, self.par, self.mask_token_id, seed, g)
        return batch

    def normalisers(self, window: Window, reduce: Any, n_tokens: int) -> tuple[float, float]:
        """The summed depth weights of all the window's positions, and its mask chains."""
        w_local = sum(float(b["packed"]["weight"].sum()) for b, _ in window)
        c_local = sum(parallel.chain_count(b["packed"]) for b, _ in window)
        return float(reduce(w_local)), float(reduce(c_local))

    def loss(
        self, tr: TrainingRun, batch: dict[str, Any], onp: bool, masked: bool, divergence: str,
        beta: float, num_tokens: float, n_chains: float,
    ) -> torch.Tensor:  # fmt: skip
        packed = batch.pop("packed")
        return parallel_loss(tr, batch, packed, onp, masked, divergence, beta, num_tokens, n_chains)

    def evaluate(self, tr: TrainingRun) -> dict[str, Any]:
        return evaluate_parallel(
            tr.accelerator.unwrap_model(tr.model),
            tr.target,
            tr.eval_batches,
            vocab=tr.vocab,
            sampling=tr.eval_sampling,
            depth=self.par.depth,
            mask_token_id=self.mask_token_id,
            device=tr.device,
        )

    @property
    def predicts_decode(self) -> bool:
        """No: a parallel round's drafts do not read their predecessors (no AR replay)."""
        return False

    def result_parallel(
        self, tr: TrainingRun, state: dict[str, Any], after: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """result.json's `parallel` section: mask token, depth, per-depth acceptance before/after."""
        before, par = state["before"], self.par
        best = next((h for h in state["history"] if h["step"] == state["best_step"]), before)
        return {
            "mask_token_id": self.mask_token_id,
            "depth": par.depth,
            "anchors": par.anchors,
            "decay": par.decay,
            "objective": par.objective,
            "alpha_at_before": before["alpha_at"],
            "alpha_at_after": (after or before)["alpha_at"],
            "alpha_at_best": best.get("alpha_at", before["alpha_at"]),
            "accepted_length_before": before["accepted_length"],
            "accepted_length_best": state["best_score"],
            "round_accepted_before": before.get("round_accepted"),
            "round_accepted_best": best.get("round_accepted", before.get("round_accepted")),
        }
