"""A parallel drafter's frozen embeddings with one row that learns: the mask token's.

p = target, q = drafter. A drafter built from the target's layers keeps the target's embeddings
and (tied) head frozen (`freeze_embeddings`: distill/train/setup.py, parallel_drafting.py): the
layers are what has to learn, and training the [V, H] matrix costs the head's weight gradient and two AdamW moments of
it every step. A parallel drafter adds one thing those rows never held: the mask token's input
embedding (distill/parallel.py), which must learn, while its head row and every other row need
not. Training the whole tied matrix for that one row is most of the extra cost of a parallel
step on a large vocabulary (distill/RESULTS.md, the real pair's parallel drafter).

So the input embedding reads the mask row from its own [H] parameter (`MaskRowEmbedding`) and
the head is untied: a frozen copy of the original matrix, so every logit the drafter computes,
the mask token's included, is the one the frozen tied head computed. The checkpoint written
(`plain_state_dict`, used by `checkpoint.export_pretrained`) is an ordinary untied model: the
embedding with the trained row, the head as the target's, `tie_word_embeddings: false`, which
`transformers`, vLLM and SGLang load as is; resume checkpoints keep the module as it trains.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MaskRowEmbedding(nn.Module):
    """`nn.Embedding` over a frozen matrix whose row `row` comes from the trainable `mask_row`."""

    def __init__(self, embedding: nn.Embedding, row: int) -> None:
        super().__init__()
        self.weight = embedding.weight  # frozen: the state dict keeps the original matrix here
        self.weight.requires_grad_(False)
        self.row = int(row)
        self.mask_row = nn.Parameter(embedding.weight[row].detach().clone())
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.padding_idx = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        return torch.where((ids == self.row).unsqueeze(-1), self.mask_row.to(out.dtype), out)

    def merged_weight(self) -> torch.Tensor:
        """The embedding matrix as a plain `nn.Embedding` holds it: the trained row in place."""
        w = self.weight.detach().clone()
        w[self.row] = self.mask_row.detach().to(w.dtype)
        return w


def train_mask_row_only(model: Any, row: int) -> int:
    """Freeze the drafter's embeddings and head except the input embedding's row `row`; untie
    the head (a frozen copy) where it was the embedding's tensor. The number of parameters
    frozen (the head's copy counted once, as the tied head was)."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if isinstance(emb, MaskRowEmbedding):
        raise ValueError("the mask row is already trainable on its own")
    frozen = emb.weight.numel()
    if head is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    elif head is not None:
        for param in head.parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    model.set_input_embeddings(MaskRowEmbedding(emb, row))
    return frozen


def plain_state_dict(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (the model's state dict) with each `MaskRowEmbedding` written as the plain
    embedding it stands for: `<name>.weight` with the trained row, no `<name>.mask_row`."""
    for name, module in model.named_modules():
        if isinstance(module, MaskRowEmbedding) and f"{name}.mask_row" in state:
            row = state.pop(f"{name}.mask_row")
            w = state[f"{name}.weight"].detach().clone()
            w[module.row] = row.detach().to(w.dtype)
            state[f"{name}.weight"] = w
    return state
