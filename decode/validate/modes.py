"""Both serving modes in one validate run: greedy and speculative sampling, each timed.

The best drafter for greedy serving is often poor for sampling and vice versa (DistillSpec), so
validate decodes in its configured mode and then in the other (`other_sampling`), reporting
each side by side. p = target, q = drafter.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from specdistill.data.runtime import ConfigError, required, spread
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DecoderSettings
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.speculative import DecodeOutput
from specdistill.decode.validate.target_only import (
    BaselinePass,
    SharedBaseline,
    TargetOnlyCache,
)


def run_all(fn: Callable, batches, seed: int) -> tuple[float, list[DecodeOutput]]:
    seconds, outs = run_each(fn, batches, seed)
    return sum(seconds), outs


def run_each(fn: Callable, batches, seed: int) -> tuple[list[float], list[DecodeOutput]]:
    """Decode each batch with `fn` (one generator for all, seeded once): seconds and output per
    batch, so figures can be grouped by batch (validate's context-length buckets)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seconds: list[float] = []
    outs: list[DecodeOutput] = []
    for ids, mask in batches:
        _timed_call(fn, ids, mask, gen, seconds, outs)
    return seconds, outs


def _timed_call(fn: Callable, ids, mask, gen, seconds: list[float], outs: list) -> None:
    """Decode one batch with `fn`, appending its wall seconds and output."""
    t0 = time.perf_counter()
    out = fn(ids, mask, generator=gen)
    seconds.append(time.perf_counter() - t0)
    outs.append(out)


class TimedPass(NamedTuple):
    """One timed repeat, batch by batch: target-only then speculative (p = target, q = drafter)."""

    base_seconds: list[float]
    base_outs: list[DecodeOutput]
    spec_seconds: list[float]
    spec_outs: list[DecodeOutput]


def merge(outs: list[DecodeOutput]) -> DecodeOutput:
    """Batches' outputs as one: tokens and rounds concatenated, every counter summed (the
    per-position and per-length lists element by element); the rows' own counters kept in row
    order where every batch has them."""
    total = DecodeOutput(tokens=[])
    for o in outs:
        for f in dataclasses.fields(DecodeOutput):
            mine, theirs = getattr(total, f.name), getattr(o, f.name)
            if f.name == "by_row":
                continue
            if f.name in ("tokens", "rounds"):
                mine.extend(theirs)
            elif isinstance(theirs, list):
                if theirs:
                    summed = [a + b for a, b in zip(mine or [0] * len(theirs), theirs)]
                    setattr(total, f.name, summed)
            else:
                setattr(total, f.name, mine + theirs)
    if all(len(o.by_row) == len(o.tokens) or len(o.tokens) == 1 for o in outs):
        total.by_row = [dataclasses.replace(r, tokens=[]) for o in outs for r in o.rows()]
    return total


def mode_name(temperature: float) -> str:
    return "greedy" if float(temperature) == 0.0 else "sampling"


def both_modes(cfg: Any) -> bool:
    """Whether validate also decodes the other serving mode (`both_modes`)."""
    return bool(required(cfg, "both_modes"))


def other_decoder(decoder: DecoderSettings, other_sampling: Any) -> DecoderSettings:
    """The decoder settings of the other serving mode: greedy when `decoder` samples, else
    sampling with `other_sampling` (gamma, cache, compile kept). Checks that spec (ConfigError)."""
    if not decoder.sampling.greedy:
        return decoder.replace(sampling=Sampling())
    side = Sampling.from_node(other_sampling, "other_sampling")
    if side.greedy:
        raise ConfigError(
            "other_sampling.temperature=0: the mode decoded beside a greedy decoder samples; "
            "set other_sampling.temperature > 0 (e.g. 1.0), or both_modes=false"
        )
    return decoder.replace(sampling=side)


def timed_repeats(
    dec, batches, seed: int, repeats: int, passes: list[TimedPass] | None = None,
    progress: str | None = None, shared: SharedBaseline | None = None,
):  # fmt: skip
    """Interleaved target-only / speculative passes (load drifts hit both alike).

    Batch by batch, target-only then speculative, so a load burst lands on both sides of a
    batch, not on one side's whole pass. Each side keeps one generator per repeat, so outputs
    are what `run_each` would give.

    Returns (baseline tokens/s per repeat, speculative tokens/s per repeat, first baseline and
    speculative outputs merged over batches). `passes` receives every repeat batch by batch (the
    per-bucket figures); `progress` labels a bar that moves between timed calls, never inside.
    `shared` (decode/validate/target_only.py): the run's target-only passes, reused when another
    validate step timed them (no target-only decode runs here), else written there once timed.
    """
    base_rates, spec_rates = [], []
    base_out = spec_out = None
    bar = repeats_bar(repeats, batches, progress)
    tok_b = tok_s = 0  # the bar's running totals over the repeats so far: target-only, ours
    sec_b = sec_s = 0.0
    timed: list[BaselinePass] = []
    for rep in range(repeats):
        gens = [torch.Generator(device="cpu").manual_seed(seed + rep) for _ in range(2)]
        tbs: list[float] = []
        tss: list[float] = []
        bo: list[DecodeOutput] = []
        so: list[DecodeOutput] = []
        reused = shared.reused[rep] if shared and shared.reused else None
        for b, (ids, mask) in enumerate(batches):
            if reused is None:
                _timed_call(dec.baseline, ids, mask, gens[0], tbs, bo)
            else:
                tbs.append(reused.seconds[b])
                bo.append(reused.outs[b])
            _timed_call(dec.generate, ids, mask, gens[1], tss, so)
            tok_b, sec_b = tok_b + emitted_tokens(bo[-1:]), sec_b + tbs[-1]
            tok_s, sec_s = tok_s + emitted_tokens(so[-1:]), sec_s + tss[-1]
            bar.update(1)
            bar.set_postfix_str(f"{tok_s * sec_b / (sec_s * max(tok_b, 1)):.2f}x")
        tb, ts = sum(tbs), sum(tss)
        if passes is not None:
            passes.append(TimedPass(tbs, bo, tss, so))
        timed.append(BaselinePass(tbs, bo))
        base_rates.append(emitted_tokens(bo) / tb)
        spec_rates.append(emitted_tokens(so) / ts)
        if rep == 0:
            base_out, spec_out = merge(bo), merge(so)
    bar.close()
    if shared is not None:
        shared.save(timed)
    assert base_out is not None and spec_out is not None
    return base_rates, spec_rates, base_out, spec_out


def repeats_bar(repeats: int, batches, label: str | None) -> tqdm:
    """A bar over timed repeats, batch by batch (validate's and the bench's): `label` names it,
    None hides it. A long prompt set, or a bench of several entries, decodes for minutes."""
    return tqdm(
        total=repeats * len(batches),
        desc=label,
        unit="prompt" if all(ids.shape[0] == 1 for ids, _ in batches) else "batch",
        disable=label is None,
        dynamic_ncols=True,
    )


def speedup_range(base_rates: list[float], spec_rates: list[float]) -> list[float]:
    """[lowest, highest] per-repeat speedup: repeat i's speculative over its target-only rate."""
    ratios = [sr / br for br, sr in zip(base_rates, spec_rates, strict=True)]
    return [round(min(ratios), 3), round(max(ratios), 3)]


def has_range(low_high: list[float] | None) -> bool:
    """Whether a `speedup_range` is worth printing: present (reports before it lack one) and
    its repeats disagree."""
    return bool(low_high) and len(low_high) >= 2 and low_high[0] != low_high[1]


def rate_text(d: dict | None) -> str:
    """A `spread` (median, min, max) as `median (min-max)`; `n/a` where none was measured."""
    return "n/a" if not d else f"{d['median']} ({d['min']}-{d['max']})"


def speedup_text(speedup: float, low_high: list[float] | None) -> str:
    """`1.09x (1.05-1.12)`: a median speedup and its per-repeat range (`speedup_range`), so a
    figure near 1.0 reads as noise or not; the median alone where `has_range` says no."""
    if not has_range(low_high):
        return f"{speedup}x"
    return f"{speedup}x ({low_high[0]}-{low_high[1]})"


def mode_figures(
    dec, base_rates, spec_rates, spec_out: DecodeOutput, shared: SharedBaseline | None = None
) -> dict[str, Any]:
    """One mode's row of report.json's `modes`: alpha, tau and the measured speedup (its
    target-only side timed by another validate step of the run where `shared` reused it)."""
    s = dec.cfg.sampling
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "alpha": round(spec_out.alpha, 4),
        "drafter_alpha": round(spec_out.drafter_alpha, 4),
        "drafter_trials": spec_out.drafter_trials,
        "tau": round(spec_out.tau, 3),
        "acceptance_by_position": spec_out.acceptance_at(),
        "speedup": round(statistics.median(spec_rates) / statistics.median(base_rates), 3),
        # each repeat's own ratio (its target-only and speculative passes ran interleaved): the
        # spread a reader needs to tell a speedup from this machine's timing noise
        "speedup_range": speedup_range(base_rates, spec_rates),
        "baseline_tokens_per_s": spread(base_rates),
        "speculative_tokens_per_s": spread(spec_rates),
        # The raw counters, so another engine's acceptance can be put on the same footing.
        "accepted_at": list(spec_out.accepted_at),
        "trials_at": list(spec_out.trials_at),
        "drafted": sum(k * n for k, n in enumerate(spec_out.draft_lengths)),  # every draft made
        "baseline_reused": bool(shared and shared.reused),
    }


def measure_other_mode(
    make: Callable[[DecoderSettings], Any], other: DecoderSettings, batches, warm, seed: int,
    repeats: int, passes: list[TimedPass] | None = None, progress: bool = False,
    cache: TargetOnlyCache | None = None,
):  # fmt: skip
    """Decode the other serving mode with a fresh decoder (same gamma), warmed up untimed;
    `passes` receives its repeats batch by batch, `progress` shows them, `cache` shares its
    target-only passes with the run's other validate steps (see `timed_repeats`)."""
    dec = make(other)
    run_all(dec.baseline, warm, seed)
    run_all(dec.generate, warm, seed)
    name = mode_name(dec.cfg.sampling.temperature)
    shared = SharedBaseline.open(cache, dec, batches, seed, repeats)
    base_rates, spec_rates, _, spec_out = timed_repeats(
        dec, batches, seed, repeats, passes, f"validate {name}" if progress else None, shared
    )
    return name, mode_figures(dec, base_rates, spec_rates, spec_out, shared)


def positions(values: list[float] | None, tested: list[int] | None = None) -> str:
    """Acceptance by draft position as `0.84 0.77 0.89 0.97`, `-` where no round reached it."""
    tested = tested or [1] * len(values or [])
    return " ".join(f"{x:.2f}" if n else "-" for x, n in zip(values or [], tested)) or "n/a"
