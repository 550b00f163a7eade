"""A full-width head for engines that run the whole head, from a drafter trained over its draft
vocabulary (`distill.draft_vocab_train`); and SGLang's token map beside it.

The drafter q was trained over the N rows of `draft_vocab_ids` only; its other rows were never
trained down, so an engine that scores every row (vLLM's `draft_model` path, which has no
draft-to-target id map; `transformers`) drafted outside the subset at many held-out positions.
Those rows must never win, and a Llama head has no bias to set to -inf.
Without a bias no row can lose for every hidden state h except by being a convex combination of
the kept rows: each row outside is set to the kept rows' centroid, so its logit is
mean_{s in S} z_s(h) <= max_{s in S} z_s(h), with equality only when all N kept logits are
equal. Greedy drafting is then exactly the subset argmax our decoder drafts (tested against
`decode.draft_vocab.SubsetHead`). Sampled drafting is not: softmax gives every outside row the
mass of an average kept token, so an engine sampling drafts from the full head drafts outside
the subset sometimes (still lossless, the acceptance rule uses the q it drafted from, only less
accepted); exact sampling needs an lm_head bias or a draft-to-target id map in the engine.
A tied head is untied first (the input embeddings of every token must stay), which costs one
[V, H] tensor more in the export.

SGLang reads `--speculative-token-map FILE` with `torch.load(FILE, weights_only=True)` as the hot
token ids of its FR-Spec head (EAGLE drafting): `write_token_map` saves the draft vocabulary so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

TOKEN_MAP_FILE = "speculative_token_map.pt"


@torch.no_grad()
def pad_head_rows(model, ids: Sequence[int]) -> int:
    """Set every LM-head row outside `ids` (and its bias) to the centroid of the rows in `ids`,
    untying a tied head first; returns the number of rows set."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head.weight is emb.weight or getattr(model.config, "tie_word_embeddings", False):
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        text = model.config.get_text_config()
        if text is not model.config:
            text.tie_word_embeddings = False
    keep = torch.tensor(list(ids), dtype=torch.long, device=head.weight.device)
    outside = torch.ones(head.weight.shape[0], dtype=torch.bool, device=keep.device)
    outside[keep] = False
    head.weight[outside] = head.weight.index_select(0, keep).mean(0).to(head.weight.dtype)
    if head.bias is not None:
        head.bias[outside] = head.bias.index_select(0, keep).mean()
    return int(outside.sum())


def write_token_map(out: Path, ids: Sequence[int]) -> Path:
    """`out/speculative_token_map.pt`: the draft vocabulary as SGLang's int64 token map."""
    path = Path(out) / TOKEN_MAP_FILE
    torch.save(torch.tensor(list(ids), dtype=torch.int64), path)
    return path
