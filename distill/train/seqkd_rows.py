"""Seq-KD rows read lazily: the generate stage's Arrow files memory-mapped, a row built when a
micro-batch asks for it.

Turning every row into Python lists (the top-k as lists of lists of floats) cost each rank about
ten times the data's bytes in RAM before the first step, and every rank held all of it. Here a
rank holds only numpy arrays of row numbers and lengths (16 bytes a row); `rows[i]` slices the
memory-mapped table, so the pages a rank touches are those of its own micro-batches' rows.
The top-k comes back as numpy views of the stored int32 / float16 columns; prompt and
completion ids as short Python lists (what `collate` and on-policy sampling concatenate).

`Examples` is what distill trains on: the lazy rows, in-memory examples (reference completions,
on-policy prompts), or both chained; `collated_lengths`, `prompts_cut`, `has_topk` and the draft
vocabulary's token counts read lengths and columns without building an `Example` per row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from specdistill.data.runtime import ConfigError
from specdistill.distill.train.example import SEQKD_COLUMNS, Example


class SeqKDRows(Sequence[Example]):
    """The rows of a generate-stage dataset with a non-empty completion, in stored order."""

    def __init__(self, table: pa.Table, index: np.ndarray, topk: bool) -> None:
        self._table = table
        self._index = index
        self.topk = topk
        self._head = "prompt_head" in table.column_names
        self.prompt_lengths = _lengths(table, "prompt_ids")[index]
        self.completion_lengths = _lengths(table, "completion_ids")[index]

    @classmethod
    def open(cls, path: str | Path, *, limit: int | None = None, use_topk: bool = True):
        """The dataset at `path` (`datasets.load_from_disk`), its first `limit` rows, checked
        in one line each: missing, not a dataset, several splits, no Seq-KD columns, no rows."""
        table = _open_table(path)
        n = table.num_rows if limit is None else min(int(limit), table.num_rows)
        completion = _lengths(table, "completion_ids")[:n]
        index = np.flatnonzero(completion > 0)
        if not len(index):
            raise ConfigError(f"data.path={str(path)!r} has no rows with a non-empty completion")
        topk = use_topk and all(c in table.column_names for c in ("topk_ids", "topk_logprobs"))
        return cls(table, index, topk)

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> Example: ...
    @overload
    def __getitem__(self, i: slice) -> list[Example]: ...
    def __getitem__(self, i: int | slice) -> Example | list[Example]:
        if isinstance(i, slice):
            return [self._row(int(j)) for j in self._index[i]]
        return self._row(int(self._index[i]))

    def __iter__(self) -> Iterator[Example]:
        for j in self._index:
            yield self._row(int(j))

    def _row(self, j: int) -> Example:
        row = self._table.slice(j, 1)
        topk_ids = topk_lp = None
        if self.topk:
            topk_ids = _matrix(row.column("topk_ids"))
            topk_lp = _matrix(row.column("topk_logprobs"))
        return Example(
            prompt_ids=_values(row.column("prompt_ids")).tolist(),
            completion_ids=_values(row.column("completion_ids")).tolist(),
            topk_ids=topk_ids,  # type: ignore[arg-type]
            topk_logprobs=topk_lp,  # type: ignore[arg-type]
            prompt_head=int(row.column("prompt_head")[0].as_py()) if self._head else 0,
        )

    def without_topk(self) -> SeqKDRows:
        return SeqKDRows(self._table, self._index, topk=False)

    def token_arrays(self, batch_rows: int = 4096) -> Iterator[np.ndarray]:
        """Prompt and completion ids of the rows, a flat array per batch of rows."""
        for start in range(0, len(self._index), batch_rows):
            rows = self._table.take(pa.array(self._index[start : start + batch_rows]))
            for name in SEQKD_COLUMNS:
                yield np.asarray(pc.list_flatten(rows.column(name)).to_numpy(zero_copy_only=False))


Examples = Union[Sequence[Example], SeqKDRows, "ExampleChain"]


class ExampleChain(Sequence[Example]):
    """Several example sources as one sequence (Seq-KD rows, then reference completions)."""

    def __init__(self, parts: Sequence[Sequence[Example]]) -> None:
        self.parts = [p for p in parts if len(p)]
        self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        part = int(np.searchsorted(self._ends, i, side="right"))
        start = int(self._ends[part - 1]) if part else 0
        return self.parts[part][i - start]

    def __iter__(self) -> Iterator[Example]:
        for part in self.parts:
            yield from part


def chain(parts: Sequence[Sequence[Example]]) -> Sequence[Example]:
    """One source as itself, several as an `ExampleChain`, none as an empty list."""
    kept = [p for p in parts if len(p)]
    if not kept:
        return []
    return kept[0] if len(kept) == 1 else ExampleChain(kept)


def _parts(examples: Sequence[Example]) -> list[Sequence[Example]]:
    return list(examples.parts) if isinstance(examples, ExampleChain) else [examples]


def lengths(examples: Sequence[Example]) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, completion lengths) of every example, from stored lengths where lazy."""
    prompts, completions = [], []
    for part in _parts(examples):
        if isinstance(part, SeqKDRows):
            prompts.append(part.prompt_lengths)
            completions.append(part.completion_lengths)
        else:
            prompts.append(np.array([len(e.prompt_ids) for e in part], dtype=np.int64))
            completions.append(np.array([len(e.completion_ids) for e in part], dtype=np.int64))
    if not prompts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(prompts), np.concatenate(completions)


def has_topk(examples: Sequence[Example]) -> bool:
    """Every example carries the target's stored top-k (read from the schema where lazy)."""
    if not len(examples):
        return False
    for part in _parts(examples):
        if isinstance(part, SeqKDRows):
            if not part.topk:
                return False
        elif not all(e.topk_ids is not None for e in part):
            return False
    return True


def topk_width(examples: Sequence[Example]) -> int:
    """K of the stored top-k (0: none)."""
    if not has_topk(examples):
        return 0
    first = examples[0].topk_ids
    return len(first[0]) if first is not None and len(first) else 0


def without_topk(examples: Sequence[Example]) -> Sequence[Example]:
    """The same rows with no stored top-k (on-policy mixes need the target loaded)."""
    parts = [
        p.without_topk()
        if isinstance(p, SeqKDRows)
        else [Example(e.prompt_ids, e.completion_ids, prompt_head=e.prompt_head) for e in p]
        for p in _parts(examples)
    ]
    return chain(parts)


def token_arrays(examples: Sequence[Example]) -> Iterator[Sequence[int]]:
    """Every example's prompt and completion ids, as flat arrays where lazy."""
    for part in _parts(examples):
        if isinstance(part, SeqKDRows):
            yield from part.token_arrays()
        else:
            for e in part:
                yield e.prompt_ids
                yield e.completion_ids


def _open_table(path: str | Path) -> pa.Table:
    import datasets

    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ConfigError(
            f"data.path={str(path)!r} does not exist: point it at a generate-stage output_dir "
            "(python -m specdistill.data.generate ...) or set data.path=null to build one"
        )
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets raises IndexError for a 0-row save, ValueError, ...
        raise ConfigError(
            f"data.path={str(path)!r} is empty or not a saved `datasets` dataset ({e!r})"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(f"data.path={str(path)!r} holds several splits; point it at one")
    missing = [c for c in SEQKD_COLUMNS if c not in ds.column_names]
    if missing:
        raise ConfigError(
            f"data.path={str(path)!r} lacks columns {missing} (has {ds.column_names}); "
            "it must be written by the generate stage"
        )
    if len(ds) == 0:
        raise ConfigError(f"data.path={str(path)!r} has no rows")
    if ds._indices is not None:  # a selection saved without flattening: read it flattened
        ds = ds.flatten_indices()
    return ds.data.table


def _lengths(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(pc.list_value_length(table.column(name)).to_numpy(), dtype=np.int64)


def _values(column: pa.ChunkedArray) -> np.ndarray:
    """The one row's list values as numpy (zero-copy for the stored ints)."""
    return pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _matrix(column: pa.ChunkedArray) -> np.ndarray:
    """The one row's [positions, K] top-k as numpy (any stored layout: fixed-size or nested)."""
    positions = pc.list_flatten(column)
    flat = pc.list_flatten(positions).to_numpy(zero_copy_only=False)
    return flat.reshape(len(positions), -1) if len(positions) else flat.reshape(0, 0)
