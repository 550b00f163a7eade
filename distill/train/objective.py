"""What the drafter q is trained against: one of the two parts a distill run is made of (the other,
how the model is spread over processes, is train/spread.py); `choose_parts` (train/parts.py)
picks both once from the settings.

Three objectives implement `Objective`, one module each:

- shared vocabulary (train/shared_vocab.py): q reads the target p's ids; the loss on p's live
  logits or its stored top-k, over the full head or the draft vocabulary's columns;
- mapped vocabulary (train/mapped_vocab.py): q has its own tokenizer and is trained as it is
  served, through the vocabulary intersection (TLI);
- parallel drafting (train/parallel_drafting.py): a PARD drafter, whose mask chains are packed
  into each micro-batch and evaluated depth by depth.

The training loop calls the objective at fixed points (after the drafter loads, when the target
is needed, per micro-batch, per window, at evaluation and in the result) and never asks which
one it holds, so a mode's code lives only in its own module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdistill.data.models.pairs import PairSpec
    from specdistill.data.sampling import Sampling
    from specdistill.distill.intersection import Intersection
    from specdistill.distill.train.example import Example
    from specdistill.distill.train.settings import TrainSettings

# A micro-batch of the accumulation window: its collated tensors and whether the drafter wrote it.
Window = list[tuple[dict[str, Any], bool]]


class TrainingRun(Protocol):
    """What an objective reads from the run it is part of (train/trainer.py's `Trainer` is one);
    named here so that the objectives never import the trainer that holds them."""

    s: TrainSettings
    accelerator: Accelerator
    model: torch.nn.Module  # the drafter q as the spread prepared it
    target: PreTrainedModel | None  # the frozen target p (None: every batch has stored top-k)
    eval_batches: list[dict[str, torch.Tensor]]
    topk: bool  # the training rows carry the target's stored top-k
    vocab: int  # logit rows compared (the tokenizer's ids)
    head_ids: torch.Tensor | None  # the draft vocabulary the head trains over
    head_inter: Intersection | None
    chunked: bool  # the loss from hidden states + head

    @property
    def eval_sampling(self) -> Sampling: ...

    @property
    def device(self) -> torch.device: ...


class Objective(Protocol):
    """What the drafter is trained against, and how its held-out figure is read."""

    def prepare_drafter(
        self, spec: PairSpec, tok: PreTrainedTokenizerBase, drafter: PreTrainedModel, device: Any
    ) -> None:
        """Right after the drafter loads, before any row is read: the objective's own set-up
        (a vocabulary mapping, a mask token); a setting it cannot run is one `error:` line."""

    def needs_target(self, train_topk: bool, eval_topk: bool) -> bool:
        """Whether the frozen target must load, given which rows carry stored top-k."""

    def load_target(
        self, spec: PairSpec, device: Any, drafter: PreTrainedModel, tok: PreTrainedTokenizerBase
    ) -> PreTrainedModel:
        """The frozen target p, checked against the drafter as this objective reads it."""

    def store_draft_vocab(
        self, drafter: PreTrainedModel, rows: Sequence[Example], tok: PreTrainedTokenizerBase
    ) -> None:
        """The decode-time draft vocabulary written into the drafter's config, where it applies."""

    def train_head(
        self, drafter: PreTrainedModel, topk: bool, device: Any
    ) -> tuple[torch.Tensor | None, Intersection | None]:
        """(ids, intersection) of the draft vocabulary the head trains over, or (None, None)."""

    def freeze_embeddings(self, drafter: PreTrainedModel) -> int:
        """`freeze_embeddings` on: what stays frozen; the number of parameters frozen."""

    def prepare_batch(self, batch: dict[str, Any], seed: int, g: int) -> dict[str, Any]:
        """Micro-batch g as the loss reads it (a parallel drafter's mask chains appended)."""

    def normalisers(self, window: Window, reduce: Any, n_tokens: int) -> tuple[float, float]:
        """(what the window's loss is divided by, mask chains in the window), across ranks;
        `reduce` sums a local figure over the processes."""

    def loss(
        self, tr: TrainingRun, batch: dict[str, Any], onp: bool, masked: bool, divergence: str,
        beta: float, num_tokens: float, n_chains: float,
    ) -> torch.Tensor:  # fmt: skip
        """One micro-batch's share of the window's loss."""

    def evaluate(self, tr: TrainingRun) -> dict[str, Any]:
        """The held-out figures of the drafter as it is now (what best/ follows)."""

    def out_tok(self, tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
        """The tokenizer saved with best/ and final/."""

    def result_data(self) -> dict[str, Any]:
        """What this objective adds to result.json's `data` section."""

    def result_parallel(
        self, tr: TrainingRun, state: dict[str, Any], after: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """result.json's `parallel` section (None unless the drafter drafts in parallel)."""

    @property
    def predicts_decode(self) -> bool:
        """Whether the held-out decode prediction (train/predict.py) can replay this drafter."""


class TokenObjective:
    """What the three objectives share unless they say otherwise: the window's loss divided by
    its loss tokens, rows collated as they are, embeddings and head frozen whole, the target's
    tokenizer saved, no `parallel` section."""

    def __init__(self, s: TrainSettings) -> None:
        self.s = s

    def prepare_drafter(
        self, spec: PairSpec, tok: PreTrainedTokenizerBase, drafter: PreTrainedModel, device: Any
    ) -> None:
        """Nothing to set up."""

    def needs_target(self, train_topk: bool, eval_topk: bool) -> bool:
        return not train_topk or not eval_topk

    def store_draft_vocab(
        self, drafter: PreTrainedModel, rows: Sequence[Example], tok: PreTrainedTokenizerBase
    ) -> None:
        """None stored."""

    def train_head(
        self, drafter: PreTrainedModel, topk: bool, device: Any
    ) -> tuple[torch.Tensor | None, Intersection | None]:
        return None, None

    def freeze_embeddings(self, drafter: PreTrainedModel) -> int:
        """The input embeddings and the LM head frozen; a tied head is counted once."""
        frozen: dict[int, torch.nn.Parameter] = {}
        for module in (drafter.get_input_embeddings(), drafter.get_output_embeddings()):
            if module is None:
                continue
            for param in module.parameters():
                param.requires_grad_(False)
                frozen[id(param)] = param  # a tied head is the embedding's tensor: counted once
        return sum(p.numel() for p in frozen.values())

    def prepare_batch(self, batch: dict[str, Any], seed: int, g: int) -> dict[str, Any]:
        return batch

    def normalisers(self, window: Window, reduce: Any, n_tokens: int) -> tuple[float, float]:
        return n_tokens, 1.0

    def out_tok(self, tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
        return tok

    def result_data(self) -> dict[str, Any]:
        return {}

    def result_parallel(
        self, tr: TrainingRun, state: dict[str, Any], after: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        return None

    @property
    def predicts_decode(self) -> bool:
        return True
