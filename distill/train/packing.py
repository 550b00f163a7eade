"""Sequence packing: a micro-batch's sequences laid end to end in as few rows as fit, each
keeping its own attention and positions.

Chat rows mix 30-token and 900-token turns; right padding to the longest row of a micro-batch makes
the decoder run over padding (a large share of the positions on the chat pair's rows). Packed, a row
holds several sequences back to back (first-fit decreasing into rows of `max_seq_len`),
`position_ids` restart at 0 for each, and the batch carries no attention mask (and the forward no
cache: `logits.model_inputs`): `transformers` then builds a mask from the position restarts
that lets a token attend only within its own sequence (masking_utils.find_packed_sequence_indices
for sdpa and eager; flash-attention's variable-length path reads the same position ids). Each
sequence sees exactly the context and positions it has unpacked, so the loss is the unpacked
loss up to floating-point summation order (tested to 1e-5).

A dense block mask computes every masked score of a row, so on CPU with sdpa or eager the
models are set to attend span by span instead (train/segment_attention.py, where `supports`
holds: the plain-head architectures), and then the whole micro-batch is one row (`one_row`): no
padding at all, and no score outside a sequence's own causal triangle.

Not every architecture reads packed positions that way (a recurrent state does not reset), so
`check_isolation` runs the model once on two short sequences packed and apart before training
and refuses, in one line, a model whose logits differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train.data import Example, cut_sequence, padding_topk, put_topk
from specdistill.distill.train.logits import model_inputs


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of the sequences in each row: first-fit decreasing (longest first, ties in
    input order), so the plan is a pure function of the lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


def collate_packed(
    examples: list[Example], pad_id: int, max_seq_len: int, one_row: bool = False
) -> dict[str, Any]:
    """`data.collate`'s batch with the sequences packed: `input_ids`, `position_ids`,
    `loss_mask` (and the stored top-k at the same positions) of [rows, longest row], no
    `attention_mask`. Each sequence is cut exactly as `collate` cuts it. `one_row`: every
    sequence in one row, no padding at all (for models attending span by span,
    train/segment_attention.py, where a long row costs no masked scores)."""
    seqs, starts, tops = zip(*(cut_sequence(ex, max_seq_len) for ex in examples))
    if one_row:
        plan = [list(range(len(seqs)))]
    else:
        plan = pack_rows([len(s) for s in seqs], max_seq_len)
    width = max(sum(len(seqs[i]) for i in row) for row in plan)
    b = len(plan)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    with_topk = all(t is not None for t in tops)
    if with_topk:
        topk_ids, topk_lp = padding_topk(b, width, len(tops[0][0][0]))
    for r, row in enumerate(plan):
        at = 0
        for i in row:
            s, st = seqs[i], starts[i]
            input_ids[r, at : at + len(s)] = torch.tensor(s)
            position_ids[r, at : at + len(s)] = torch.arange(len(s))
            loss_mask[r, at + st - 1 : at + len(s) - 1] = True
            if with_topk:
                put_topk(topk_ids, topk_lp, r, at + st - 1, tops[i])
            at += len(s)
        position_ids[r, at:] = torch.arange(width - at)  # padding: a sequence of its own
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
    }
    if with_topk:
        batch["topk_ids"], batch["topk_lp"] = topk_ids, topk_lp
    return batch


@torch.no_grad()
def check_isolation(model: Any, role: str, name: str, vocab: int, atol: float = 1e-3) -> None:
    """Refuse, in one line, a model whose packed logits differ from its unpacked ones (it does
    not restart attention and positions at a `position_ids` restart)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(0, vocab, (1, 5), generator=gen).to(device)
        b = torch.randint(0, vocab, (1, 7), generator=gen).to(device)
        apart = [model(input_ids=x, use_cache=False).logits.float() for x in (a, b)]
        pos = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
        joined = model(**model_inputs(torch.cat([a, b], 1), None, pos)).logits.float()
        gap = float((joined - torch.cat(apart, 1)).abs().max())
    except Exception as e:  # a forward that rejects position_ids, a cache it insists on, ...
        raise ConfigError(
            f"pack_sequences=true: the {role} ({name}) cannot run packed sequences ({e!r}); "
            "set pack_sequences=false"
        ) from e
    finally:
        model.train(was_training)
    if gap > atol:
        raise ConfigError(
            f"pack_sequences=true: the {role} ({name}) lets packed sequences see each other "
            f"(its logits move by {gap:.2g} when a sequence follows another; an architecture "
            "with a recurrent state or its own masking); set pack_sequences=false"
        )
