"""A drafter with its own tokenizer as the objective of a distill run (train/objective.py),
trained in the form it is served (TLI): rows stay in the target's tokens and reach the drafter
through the vocabulary mapping, the loss is the intersection's `tli_loss`, best/ follows the
held-out TLI acceptance and carries the drafter's own tokenizer. The mapping and its loss are
train/mapped.py's (`MappedPair`); this module is the part the training loop calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdistill.distill.train.mapped import (
    MappedPair,
    check_mapped_config,
    load_mapped_target,
    prepare_mapped,
)
from specdistill.distill.train.objective import TokenObjective, TrainingRun

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdistill.data.models.pairs import PairSpec
    from specdistill.distill.train.settings import TrainSettings


class MappedVocab(TokenObjective):
    """The drafter reads the target's tokens mapped to its own ids (train/mapped.py). No decode
    prediction: the held-out replay (train/predict.py) reads shared ids."""

    def __init__(self, s: TrainSettings) -> None:
        super().__init__(s)
        check_mapped_config(s)  # what a mapped pair cannot run: one line, before any weights
        self._pair: MappedPair | None = None  # built from the tokenizers (`prepare_drafter`)

    @property
    def pair(self) -> MappedPair:
        if self._pair is None:
            raise RuntimeError("MappedVocab.prepare_drafter builds the mapping before it is read")
        return self._pair

    def prepare_drafter(
        self, spec: PairSpec, tok: PreTrainedTokenizerBase, drafter: PreTrainedModel, device: Any
    ) -> None:
        self._pair = prepare_mapped(self.s, spec, tok, drafter, device)

    def load_target(
        self, spec: PairSpec, device: Any, drafter: PreTrainedModel, tok: PreTrainedTokenizerBase
    ) -> PreTrainedModel:
        return load_mapped_target(spec, self.s, device, self.pair)

    def loss(
        self, tr: TrainingRun, batch: dict[str, Any], onp: bool, masked: bool, divergence: str,
        beta: float, num_tokens: float, n_chains: float,
    ) -> torch.Tensor:  # fmt: skip
        temperature = self.s.loss.temperature
        return self.pair.loss(tr, batch, masked, divergence, beta, temperature, num_tokens)

    def evaluate(self, tr: TrainingRun) -> dict[str, Any]:
        drafter = tr.accelerator.unwrap_model(tr.model)
        return self.pair.evaluate(drafter, tr.target, tr.eval_batches, tr.eval_sampling, tr.device)

    def out_tok(self, tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
        """The drafter's own tokenizer."""
        return self.pair.draft_tok

    def result_data(self) -> dict[str, Any]:
        return self.pair.summary

    @property
    def predicts_decode(self) -> bool:
        return False
