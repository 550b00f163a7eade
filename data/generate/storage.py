"""How Seq-KD rows are stored: the row schema, and the target's top-k as compact columns.

At a user's scale (1e5 conversations x 2k tokens, K = 32) the top-k table is most of the data:
2e8 positions x 32 entries. It is stored as int32 ids (vocabularies are < 2^31) and float16
log-probs in fixed-size lists (no per-position offsets): 6 bytes an entry, where int64 + fp32
in nested variable lists took 12 plus offsets.

float16's error is relative: a stored log-prob l differs from the fp32 one by at most
|l| * 2^-11 (half a unit in the last of its 11 significant bits; subnormals, |l| < 6.1e-5,
by at most 2^-25 absolute), so p = exp(l) moves by a factor exp(+-|l| * 2^-11), and the top-k
mass, and any sum_k min(p_k, q_k) over the K entries, by at most B = 2^-11 * sum_k p_k |l_k|
(<= 2^-11 * ln K, below 2e-3 at K = 32: `logprob_error_bound`); the (K+1)-way acceptance
with a rest bucket (1 - the top-k mass: `distill/losses.py::topk_logprobs`) by at most 2B. Log-probs below float16's
range (-65504) are stored as -65504 (p = 0 either way), never as -inf, so p log p stays 0.
Chunks written before this layout (int64 ids, fp32 log-probs) are cast when merged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

TOPK_COLUMNS = ("topk_ids", "topk_logprobs")
ID_TYPE = pa.int32()
LOGPROB_TYPE = pa.float16()
LOGPROB_MIN = float(np.finfo(np.float16).min)  # -65504: the lowest finite float16
F16_RELATIVE_ERROR = 2.0**-11


def chunk_schema(topk: int, chat: bool = False) -> pa.Schema:
    """The row schema the distill stage reads (see the generate stage's docstring); `topk` = K
    stored entries per completion position (0: none). Chat sets' rows also name their
    conversation, turn and head tokens (`data/generate/turns.py`)."""
    fields = [
        ("prompt_index", pa.int64()),
        ("sample_index", pa.int64()),
        ("prompt", pa.string()),
        ("prompt_ids", pa.list_(ID_TYPE)),
        ("completion", pa.string()),
        ("completion_ids", pa.list_(ID_TYPE)),
        ("finish_reason", pa.string()),
    ]
    if topk:
        fields += [
            ("topk_ids", pa.list_(pa.list_(ID_TYPE, topk))),
            ("topk_logprobs", pa.list_(pa.list_(LOGPROB_TYPE, topk))),
        ]
    if chat:
        fields += [("conversation_index", pa.int64()), ("turn", pa.int64())]
        fields += [("prompt_head", pa.int64())]
    return pa.schema(fields)


def topk_column(values: Sequence[Any], k: int, dtype: pa.DataType) -> pa.Array:
    """Per-row [positions, K] arrays (nested lists or numpy) as list<fixed_size_list<K>>,
    built from one flat numpy buffer rather than element by element."""
    np_dtype = np.int32 if dtype == ID_TYPE else np.float16
    arrays = [
        np.asarray(v, dtype=np.float64 if np_dtype is np.float16 else np.int64) for v in values
    ]
    lengths = [a.shape[0] if a.size else 0 for a in arrays]
    for a, n in zip(arrays, lengths):
        if n and (a.ndim != 2 or a.shape[1] != k):
            raise ValueError(f"a top-k row of shape {a.shape} where [positions, {k}] is stored")
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    if np_dtype is np.float16:
        flat = np.maximum(flat, LOGPROB_MIN)  # below float16's range: p = 0, never -inf
    flat = flat.astype(np_dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=dtype), k)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


def rows_table(rows: Sequence[Mapping[str, Any]], topk: int, chat: bool = False) -> pa.Table:
    """A chunk's rows as a table of `chunk_schema`: the top-k columns built from numpy."""
    schema = chunk_schema(topk, chat)
    plain = [n for n in schema.names if n not in TOPK_COLUMNS]
    columns = {n: pa.array([r[n] for r in rows], type=schema.field(n).type) for n in plain}
    if topk:
        columns["topk_ids"] = topk_column([r["topk_ids"] for r in rows], topk, ID_TYPE)
        lps = [r["topk_logprobs"] for r in rows]
        columns["topk_logprobs"] = topk_column(lps, topk, LOGPROB_TYPE)
    return pa.table([columns[n] for n in schema.names], schema=schema)


def as_storage(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A chunk read back in `schema`: one written before this layout (int64 ids, fp32
    log-probs, variable lists) is cast; fp32 log-probs below -65504 become -65504."""
    if table.schema.equals(schema):
        return table
    if "topk_logprobs" in table.column_names:
        lp = table.column("topk_logprobs")
        if (
            pa.types.is_floating(lp.type.value_type.value_type)
            and lp.type != schema.field("topk_logprobs").type
        ):
            table = table.set_column(
                table.column_names.index("topk_logprobs"), "topk_logprobs", _clamped(lp)
            )
    return table.select(schema.names).cast(schema)


def _clamped(column: pa.ChunkedArray) -> pa.ChunkedArray:
    import pyarrow.compute as pc

    out = []
    for chunk in column.chunks:
        inner = chunk.flatten()
        values = pc.max_element_wise(inner.flatten(), pa.scalar(LOGPROB_MIN, inner.type.value_type))
        width = inner.type.list_size if pa.types.is_fixed_size_list(inner.type) else None
        if width is None:  # variable inner lists: rebuild them from their own offsets
            rebuilt = pa.ListArray.from_arrays(_offsets(inner), values)
        else:
            rebuilt = pa.FixedSizeListArray.from_arrays(values, width)
        out.append(pa.ListArray.from_arrays(_offsets(chunk), rebuilt))
    return pa.chunked_array(out, type=column.type)


def _offsets(array: pa.Array) -> pa.Array:
    """Offsets of a list array rebased to its own values (a slice's start at 0)."""
    offsets = np.asarray(array.offsets)
    return pa.array((offsets - offsets[0]).astype(np.int32))


def topk_bytes(table: pa.Table) -> tuple[int, int]:
    """(bytes of the stored top-k columns, (id, log-prob) entries they hold)."""
    if "topk_ids" not in table.column_names:
        return 0, 0
    ids = table.column("topk_ids")
    entries = sum(len(c.flatten().flatten()) for c in ids.chunks)
    return ids.nbytes + table.column("topk_logprobs").nbytes, entries


def logprob_error_bound(logprobs: np.ndarray) -> np.ndarray:
    """Per position, the most float16 storage can move any sum_k min(p_k, q_k) (an acceptance
    probability) or the stored top-k mass: 2^-11 * sum_k p_k |l_k| over the row's K entries
    (module docstring), plus float16's absolute floor for subnormals."""
    lp = np.asarray(logprobs, dtype=np.float64)
    p = np.exp(lp)
    return (
        F16_RELATIVE_ERROR
        * (p * np.abs(lp)).sum(-1)
        * math.e ** (F16_RELATIVE_ERROR * np.abs(lp).max(-1, initial=0.0))
        + lp.shape[-1] * 2.0**-24
    )
