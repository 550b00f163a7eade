"""`decoder.cpu_matmul=auto`: each model's few-row linear layout, timed on the CPU at hand.

`decode.cpu_matmul`'s weight-major path made an AVX2 EPYC's (gamma+1)-token verify cost about
one 1-token step where `F.linear` cost several, and on an AVX-512 / AMX Xeon it made the same
verify cost 1.7 steps where `F.linear` cost 1.1 (decode/RESULTS.md, 2026-11-28): which path wins
is the machine's, not the model's; and on that Xeon oneDNN over prepacked weights beat both from
4 rows up, where MKL's `F.linear` switches kernels (decode.cpu_matmul). So `auto` times the
three in the decoder's own steps: each model's
runner (same caches, lean steps and draft head as the decode) on a short synthetic context, at
the widths its decode steps feed (verify widths for the target, catch-up and parallel widths
for the drafter, and every model's 1-token step: target-only decoding, the floor's plain steps
and sequential drafting are made of them, and on some CPUs MKL's 1-row GEMV loses to the 2-column
product over every weight, on others only over a tall, narrow one or none), the
layouts and the two models interleaved sample by sample, so each step runs after the other
model's as it does in a decode (that eviction is what the weight-major path streams better).
The fastest sample of each, not the median: on a shared VM other tenants' load only adds time,
and there medians picked a different layout run to run where the fastest samples agreed
(decode/RESULTS.md, 2026-12-01). Weight-major only where it is clearly faster (`MARGIN`: a tie
keeps `F.linear`, the kernel library's own choice), and the prepacked path from the width where
it is clearly faster at every timed width above (a kernel switch is a step in the cost, so the
widths between two timed ones follow them). A model whose layout does not take the prepacked
path frees its reordered weights. Memoised per model: validate's decoders over one pair time
once, and its target-only baseline keeps the layout its speculative decodes use.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch

from specdistill.decode.cache import ModelRunner
from specdistill.decode.cpu_matmul import (
    LINEAR,
    MAX_ROWS,
    PACKED,
    TWO_COLUMN,
    WEIGHT_MAJOR,
    Layout,
    drop_packed,
    packed_available,
)

MARGIN = 0.95  # a path other than F.linear must take under this share of its rival's time
CONTEXT = 64  # synthetic context tokens the timed steps attend over
LAYOUTS = {
    "linear": LINEAR,
    "weight_major": WEIGHT_MAJOR,
    "packed": PACKED,
    "two_column": TWO_COLUMN,  # timed for one row only: its wider steps are weight_major's
}

# model -> {(widths, one_row, key): Layout}; weak, so a freed model drops its entry
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decide(times: Mapping[tuple[str, int], float], widths: Iterable[int], one_row: bool) -> Layout:
    """The layout from step times `times[(layout name, width)]` (seconds): weight-major
    for few rows when its summed time over `widths` (>= 2) is under MARGIN of F.linear's; for
    one row, the faster of the 2-column product over every weight (`two_column`, where timed)
    and over the tall, narrow weights only (one_row: the model has one) when it is under MARGIN
    of F.linear's 1-token step; then the prepacked path (where timed) from the smallest width w
    at which it is under MARGIN of that few-row choice at w and at every timed width above it."""
    few = sorted(w for w in widths if 2 <= w <= MAX_ROWS)
    few_rows = bool(few) and sum(times["weight_major", w] for w in few) < MARGIN * sum(
        times["linear", w] for w in few
    )
    ones = {"two_column": times.get(("two_column", 1))}
    if one_row:
        ones["weight_major"] = times["weight_major", 1]
    timed = {name: t for name, t in ones.items() if t is not None}
    best = min(timed, key=timed.__getitem__, default=None)
    one = best is not None and timed[best] < MARGIN * times["linear", 1]
    one_all = one and best == "two_column"
    rival = "weight_major" if few_rows else "linear"
    packed_from = 0
    for w in reversed(few):
        if ("packed", w) not in times or times["packed", w] >= MARGIN * times[rival, w]:
            break
        packed_from = w
    return Layout(few_rows=few_rows, one_row=one, one_row_all=one_all, packed_from=packed_from)


@torch.inference_mode()
def time_layouts(
    make_runner: Mapping[str, Callable[[int, Layout], ModelRunner]],
    widths: Mapping[str, tuple[int, ...]],
    vocab: Mapping[str, int],
    device: torch.device,
    iters: int = 10,
    reps: int = 1,
    one_row: Mapping[str, bool] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, dict[tuple[str, int], float]]:
    """Per role: the fastest sample's seconds of `reps` back-to-back steps of each width, per
    layout.
    make_runner[role](slots, layout) builds that role's runner as the decoder would;
    `one_row[role]` False: the role has no tall, narrow weight, so its weight-major 1-token
    step is F.linear's again and is not timed (default: every role's is). `dtype`: the
    models' weights; the prepacked path is timed only where `packed_available` allows it."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    runners: dict[tuple[str, str], ModelRunner] = {}
    layouts = {n: lay for n, lay in LAYOUTS.items() if n != "packed" or packed_available(dtype)}
    for role, make in make_runner.items():
        ids = torch.randint(0, vocab[role], (1, CONTEXT), generator=gen).to(device)
        for name, layout in layouts.items():
            runner = make(CONTEXT + max(widths[role]) + 2, layout)
            runner.forward(ids, keep=1, prefill=True)
            runners[role, name] = runner
    samples: dict[str, dict[tuple[str, int], list[float]]] = {
        role: {
            (name, w): []
            for name in layouts
            for w in widths[role]
            if _timed(name, w, (one_row or {}).get(role, True))
        }
        for role in make_runner
    }
    names = list(layouts)
    for i in range(iters + 1):  # the first pass warms every shape up
        for w in sorted({w for ws in widths.values() for w in ws}):
            for name in names if i % 2 else names[::-1]:  # alternate which layout goes first
                for role in make_runner:
                    if (name, w) not in samples[role]:
                        continue
                    runner = runners[role, name]
                    base, x = runner.length, torch.zeros(1, w, dtype=torch.long, device=device)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        runner.forward(x, keep=w)
                        runner.rollback(base)
                    if i:
                        samples[role][name, w].append(time.perf_counter() - t0)
    return {role: {key: min(v) for key, v in per.items()} for role, per in samples.items()}


def _timed(name: str, width: int, one_row: bool = True) -> bool:
    """The prepacked path takes 2 rows and more: its 1-token step would time `F.linear` again;
    the 2-column layout differs from weight-major only in its 1-token step; weight-major's
    1-token step is its own only over a tall, narrow weight (`one_row`)."""
    if name == "packed":
        return width >= 2
    if name == "weight_major" and width == 1:
        return one_row
    return name != "two_column" or width == 1


def choose_layouts(
    models: Mapping[str, torch.nn.Module],
    make_runner: Mapping[str, Callable[[int, Layout], ModelRunner]],
    widths: Mapping[str, tuple[int, ...]],
    one_row: Mapping[str, bool],
    device: torch.device,
    key: Mapping[str, object] | None = None,
) -> dict[str, Layout]:
    """Each role's layout (see the module docstring): remembered per model, timed for the roles
    not yet known (with the known ones' steps interleaved all the same). `one_row[role]`: the
    role's runner has a tall, narrow weight whose 1-token steps could take the 2-column path
    alone; every role's 1-token step is timed; `key`: what else makes a role's layout its own
    (e.g. a draft vocabulary's head)."""
    key = key or {}
    entry = {
        role: (tuple(sorted(set(widths[role]))), one_row[role], key.get(role)) for role in models
    }
    known = {role: _MEMO.get(model, {}).get(entry[role]) for role, model in models.items()}
    if all(layout is not None for layout in known.values()):
        return {role: known[role] for role in models}
    timed_widths = {role: tuple(sorted(set(widths[role]) | {1})) for role in models}
    vocab = {role: int(model.config.vocab_size) for role, model in models.items()}
    dtype = next(next(iter(models.values())).parameters()).dtype  # one dtype: a checked pair
    times = time_layouts(make_runner, timed_widths, vocab, device, one_row=one_row, dtype=dtype)
    out = {}
    for role, model in models.items():
        layout = known[role] or decide(times[role], widths[role], one_row[role])
        _MEMO.setdefault(model, {})[entry[role]] = layout
        out[role] = layout
        if not layout.packed_from and not _takes_packed(model):
            drop_packed(model)  # timing made the reordered copy; this model's steps never read it
    return out


def _takes_packed(model: torch.nn.Module) -> bool:
    """Whether any layout remembered for `model` (another drafter's pairing, another width set)
    reads its reordered weights."""
    return any(layout.packed_from for layout in _MEMO.get(model, {}).values())
