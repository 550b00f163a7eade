"""Few-row linear layers on CPU in weight-major order, for the verify step.

A (gamma+1)-token verify runs every linear layer on 2-16 rows. On CPU, `F.linear(x, W)` hands
that to MKL as `x @ W.T`, a GEMM with the weight as the transposed operand, which on an AVX2
machine costs several times the 1-row GEMV that reads the same weight bytes when the weights are
out of cache; `W @ x.T` streams W row by row like the GEMV does (a 1-row step costs the same
either way). Decode steps read weights that the other model's step just evicted, so that is the
case that counts, and it brings a verify back near the one target step the speedup formula
assumes (figures: decode/RESULTS.md, 2026-11-23 "decoder step modes").

One-row steps have the mirror problem with tall, narrow weights (a large vocabulary over a small
hidden size, e.g. SmolLM2's tied LM head): MKL's 1-row GEMV there is slower than
`W @ [x, x].T` (the row twice, one column kept). So a 1-token step over such a weight
(`ONE_ROW_MIN`, `ONE_ROW_MAX_IN`) takes the 2-column product (figures: decode/RESULTS.md,
2026-11-25 "few-row linears on CPU"); on that AVX2 machine wider weights kept the GEMV. On an
AVX-512 EPYC without AMX the GEMV lost on every weight (decode/RESULTS.md, 2026-12-01 "one row
as two columns"), and a target-only baseline that keeps it reads every speculative decode's
speedup too high. So a layout may take the 2-column product for one row over every weight
(`one_row_all`), and `auto` times the 1-token step of every model.

Neither holds on every CPU: on an AVX-512 / AMX Xeon the weight-major verify of the toy target
cost 1.7 of its 1-token steps against 1.1 through `F.linear`. There a third path wins from a few
rows up: MKL's `F.linear` switches kernels at 4 rows and its cost jumps, where oneDNN's linear
over a weight reordered once into its own blocked layout (`packed_linear`) costs about the same
from 1 row to 9 (decode/RESULTS.md, 2026-11-28 "oneDNN's prepacked weights"). The reordered copy
costs the model's linear weights again in memory, so it is made only for a model whose layout
takes it. So a `Layout` says which path a model's few-row inputs take, and
`decoder.cpu_matmul=auto` times them on the machine at hand (`decode/matmul_choice.py`).

The switch is scoped: `weight_major_linear()` swaps `torch.nn.Linear.forward` for the duration of
one decode step (the decoder is single-threaded), and only for inputs of 2-16 rows or one row
(over a tall, narrow weight, or every weight), as the layout allows; prefill and everything
outside the decoder keep `F.linear`. Results agree with `F.linear` to float rounding (a
different summation order), like any other change of GEMM kernel.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # above this a GEMM is compute-bound and MKL's own choice is the better one
# One row goes as two columns over a weight of >= ONE_ROW_MIN elements with <= ONE_ROW_MAX_IN
# inputs: a tall, narrow weight (a large vocabulary over a small hidden size) is where the GEMV
# loses; from 2048 inputs on it wins (decode/RESULTS.md, 2026-11-25 "few-row linears on CPU").
ONE_ROW_MIN = 1 << 22
ONE_ROW_MAX_IN = 1024


@dataclass(frozen=True)
class Layout:
    """Which few-row inputs a model's decode steps compute weight-major (the rest: `F.linear`)."""

    few_rows: bool = False  # 2..MAX_ROWS rows as weight @ x.T (verify and catch-up steps)
    one_row: bool = False  # one row over a tall, narrow weight as a 2-column GEMM
    one_row_all: bool = False  # one row over every weight as a 2-column GEMM
    packed_from: int = 0  # packed_from..MAX_ROWS rows (>= 2) through `packed_linear`; 0: none

    @property
    def any(self) -> bool:
        return self.few_rows or self.one_row or self.one_row_all or self.packed_from > 0

    def one_row_over(self, weight: torch.Tensor) -> bool:
        """Whether a 1-row input over `weight` goes as two columns."""
        return self.one_row_all or (self.one_row and two_column(weight))

    def packs(self, rows: int) -> bool:
        """Whether an input of `rows` rows takes oneDNN's prepacked weight."""
        return 2 <= self.packed_from <= rows <= MAX_ROWS

    def switches(self, rows: int) -> bool:
        """Whether a step of `rows` (>= 2) tokens per row needs the swapped `Linear.forward`."""
        return self.few_rows or self.packs(rows)

    def describe(self) -> str:
        """The layout in words, for reports (which kernel path each row count takes)."""
        parts = []
        upto = self.packed_from - 1 if self.packed_from else MAX_ROWS
        if self.few_rows and upto >= 2:  # prepacked from 2 rows leaves weight-major none
            parts.append(f"W @ x.T for 2-{upto} rows")
        if self.packed_from:
            parts.append(f"oneDNN prepacked for {self.packed_from}-{MAX_ROWS} rows")
        if self.one_row_all:
            parts.append("1 row as 2 columns")
        elif self.one_row:
            parts.append("1 row over a tall, narrow weight as 2 columns")
        return "; ".join(parts) + ("; F.linear otherwise" if parts else "F.linear")


LINEAR = Layout()
WEIGHT_MAJOR = Layout(few_rows=True, one_row=True)
TWO_COLUMN = Layout(few_rows=True, one_row=True, one_row_all=True)  # auto's third 1-row choice
PACKED = Layout(packed_from=2)
_active = WEIGHT_MAJOR  # the layout inside `weight_major_linear` (the decoder is single-threaded)


# Linear module -> (the weight's tensor version when reordered, oneDNN's reordered weight); weak,
# so a freed model drops its copies
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packed_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's linear over a prepacked weight (CPU builds do) for
    weights of `dtype`: float32 only. oneDNN's bf16 reorder needs AVX-512 or AVX-NE-CONVERT and
    raises on an AVX2-only CPU, and which path runs must never depend on the CPU's features."""
    ops = torch.ops.mkldnn
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def packed_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through oneDNN with the weight reordered once into oneDNN's blocked layout.
    The copy is remade when the weight changes in place (online adaptation trains a drafter
    between decodes), so it never serves stale weights."""
    weight = module.weight
    version = -1 if weight.is_inference() else weight._version  # inference tensors never change
    got = _PACKED.get(module)
    if got is None or got[0] != version:
        with torch.inference_mode():
            got = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        _PACKED[module] = got
    return torch.ops.mkldnn._linear_pointwise(x, got[1], module.bias, "none", [], "")


def drop_packed(model: torch.nn.Module) -> None:
    """Free the reordered copies of `model`'s weights (its layout does not take them)."""
    for m in model.modules():
        _PACKED.pop(m, None)


def two_column(weight: torch.Tensor) -> bool:
    """Whether a 1-row input over this weight goes as two columns (a tall, narrow weight)."""
    return weight.numel() >= ONE_ROW_MIN and weight.shape[1] <= ONE_ROW_MAX_IN


def has_two_column_weight(model: torch.nn.Module) -> bool:
    """Whether any linear layer of `model` takes the 1-row path: only then do its 1-token steps
    need the switch (the toy models' never do, so their steps keep plain `F.linear`)."""
    return any(isinstance(m, torch.nn.Linear) and two_column(m.weight) for m in model.modules())


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: Layout = WEIGHT_MAJOR,
):
    """`F.linear(x, weight, bias)`, computed as `weight @ x.T` when x has 2..MAX_ROWS rows, or
    one row (as two equal columns, one kept) over a tall, narrow weight or every weight, as
    `layout` allows."""
    rows = x.numel() // max(x.shape[-1], 1)
    one_row = rows == 1 and layout.one_row_over(weight)
    if not (one_row or (layout.few_rows and 2 <= rows <= MAX_ROWS)):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if one_row:  # the row twice: a 2-column GEMM streams the weight faster than the 1-row GEMV
        # (`cat`, not `repeat`: repeat's own bookkeeping costs several times the copy)
        y = torch.mm(weight, torch.cat((flat, flat)).t())[:, 0].contiguous()
    else:
        y = torch.mm(weight, flat.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _active.packs(x.numel() // max(x.shape[-1], 1)):
        return packed_linear(self, x)
    return few_row_linear(x, self.weight, self.bias, _active)


@contextmanager
def weight_major_linear(enabled: bool = True, layout: Layout = WEIGHT_MAJOR) -> Iterator[None]:
    """Within the block, every `nn.Linear` computes few-row inputs as `weight @ x.T` or through
    its prepacked weight where `layout` says so."""
    global _active
    if not enabled or not layout.any:
        yield
        return
    previous, previous_layout = torch.nn.Linear.forward, _active
    torch.nn.Linear.forward, _active = _forward, layout
    try:
        yield
    finally:
        torch.nn.Linear.forward, _active = previous, previous_layout
