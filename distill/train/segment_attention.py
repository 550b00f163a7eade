"""Attention over packed sequences one sequence at a time: the variable-length path of
flash-attention, built from `torch.nn.functional.scaled_dot_product_attention` (used on CPU).

A packed row (train/packing.py) holds several sequences whose `position_ids` restart at 0.
Through `sdpa` or `eager`, `transformers` makes that row's mask a dense [n, n] block-diagonal
causal grid and computes every score of it, the masked ones too: packing then only pays where
sequences are short against the row, and rows must stay at `max_seq_len` so the grid stays
small. Here each sequence is attended alone (`is_causal` over its own span), which is exactly
the block-diagonal mask's result with none of the masked scores, so the whole micro-batch can
be one row with no padding at all (`packing.collate_packed(one_row=True)`).

Registered with `transformers` as `ATTENTION` (its attention and mask interfaces). Every call
that carries an attention mask (padded batches, the held-out evaluation, generation) or a
cache offset goes to `sdpa` unchanged, and a row without restarts is one span, so a model set
to it computes what `sdpa` computes everywhere; `packing.check_isolation` still runs before
training. Only for the plain-head architectures (`logits.PLAIN_HEAD`) without a sliding
window (`supports`): a window would cut a span's attention further. On CPU only: a GPU keeps
`transformers`' own packed path (flash-attention's variable-length kernel where the model runs
it), since a Python loop of small kernels per span and layer is a CPU's trade, not a GPU's.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.distill.train.logits import PLAIN_HEAD

ATTENTION = "specdistill_segments"


def spans(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each sequence of one packed row: a new one wherever the position does
    not follow the previous one (a restart at 0, or any jump)."""
    bounds = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    return list(zip(bounds, [*bounds[1:], len(positions)], strict=True))


def segments_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`transformers`' attention signature: query [b, h, n, d], key/value [b, h_kv, n, d];
    returns [b, n, h, d]. Spans of a packed row are attended one by one (causal each)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = []
    for r, positions in enumerate(position_ids.expand(query.shape[0], -1).tolist()):
        parts = [
            sdpa_attention_forward(
                module,
                query[r : r + 1, :, a:b],
                key[r : r + 1, :, a:b],
                value[r : r + 1, :, a:b],
                None,
                dropout=dropout,
                scaling=scaling,
                is_causal=True,
            )[0]
            for a, b in spans(positions)
        ]
        rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0), None


def segments_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask where `segments_attention` reads the spans from the positions (no padding
    mask, no cache offset); otherwise `sdpa`'s own mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_offset == kv_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def register() -> str:
    """Register `ATTENTION` with `transformers` (idempotent); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, segments_attention)
    AttentionMaskInterface.register(ATTENTION, segments_mask)
    return ATTENTION


def supports(model: Any) -> bool:
    """Whether `model` may attend packed rows span by span: a plain-head architecture on CPU
    running `sdpa` or `eager`, with no sliding window in any attention module."""
    params = next(iter(model.parameters()), None)
    if params is None or params.device.type != "cpu":
        return False
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", ATTENTION):
        return False
    return all(getattr(m, "sliding_window", None) is None for m in model.modules())


def use_segments(model: Any) -> None:
    """Set `model` to attend packed rows span by span (`supports` must hold)."""
    model.set_attn_implementation(register())
