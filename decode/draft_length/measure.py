"""Where the pair's `DraftCosts` come from when the config says `auto`: timed on this device.

p = target, q = drafter, c = one drafter step in target steps. The adaptive draft-length
policies plan with these costs (`costs.py`); the forwards are timed with the decoder's own caches
(`SpeculativeDecoder.step_timer`), medians over blocks of steps, the models interleaved so load
drifts on a shared machine hit both alike. The round's host-side glue (sampling and testing
drafts, moving them to the host, rollbacks, bookkeeping) is timed in the decoder's own rounds
(`round_glue`): on a small CPU pair it is a tenth of a target step and more, and at
temperature 1 it grows with each draft, so no constant prices it in both serving modes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from specdistill.decode.cache import ForwardClock
from specdistill.decode.draft_length.costs import MIN_OVERHEAD, DraftCosts
from specdistill.decode.draft_length.costs_memo import CostsMemo, ForwardTimings


@torch.inference_mode()
def time_forwards(dec, ids: torch.Tensor, iters: int = 16) -> ForwardTimings:
    """The forwards a measurement prices, each as its median ratio to the target step timed
    beside it (robust to load that drifts between samples on a shared machine)."""
    k = dec.max_draft
    plen = ids.shape[1]
    timer = dec.step_timer(ids, plen + max(dec.verify_widths[-1], k + 1) + 2)
    parallel = dec.parallel
    # by_width: every verify width 1..k drafts; linear: the two ends the line goes through
    widths = range(1, k + 1) if dec.cfg.verify_costs == "by_width" else sorted({1, k})
    ratios: dict[str, list[float]] = {"d": [], "dk": []} | {f"v{j}": [] for j in widths}
    steps: list[float] = []  # seconds of a target step, the unit of the glue
    for i in range(iters + 1):  # the first round is warm-up
        tt = timer.target_step()
        got = {
            # parallel: one drafter forward of 2 tokens (an accepted draft and the pending
            # token) proposes 1 draft, each further proposal adds a mask (timed at k masks)
            "d": timer.draft(1),
            "dk": timer.draft(k) if parallel else 0.0,
        } | {f"v{j}": timer.verify(j) for j in widths}
        tt = (tt + timer.target_step()) / 2
        if i:
            steps.append(tt)
            for key, v in got.items():
                ratios[key].append(v / tt)
    med = {key: statistics.median(v) for key, v in ratios.items()}
    step = statistics.median(steps)
    med["pq"], med["pf"] = prefill_line(timer, step)
    return ForwardTimings(med, step)


# the short prefill that splits the drafter's lazy prefill into a fixed part and a per-token one
PREFILL_SHORT = 8
# target steps ahead of each timed short prefill: a decode's first drafting round finds the
# drafter's weights evicted by the target's prefill or by the floor's plain steps (its shortest
# interval, probe_every's default), and a small drafter's prefill then costs most of a target
# step more than back to back on a warm cache (decode/RESULTS.md)
COLD_STEPS = 8


def prefill_line(timer, step: float) -> tuple[float, float]:
    """The drafter's lazy prefill as a line in prompt tokens, in target steps: (per token,
    fixed). Through two points: the whole prompt's prefill as the timer ran it (its runner's
    build included) and the median of a few fresh ones of `PREFILL_SHORT` tokens, each after
    `COLD_STEPS` target steps as a decode runs it; a prompt too short for two points is all
    per-token, as before."""
    fed = max(1, timer.role_ids["drafter"].shape[1] - 1)
    # `prefill` is per token of the whole prompt; its runner's build was timed apart
    whole = timer.prefill("drafter") * fed + timer.build_seconds.get("drafter", 0.0)
    if fed <= 2 * PREFILL_SHORT:
        return whole / fed / step, 0.0

    def evict() -> None:
        for _ in range(COLD_STEPS):
            timer.target_step(reps=1)

    short = timer.prefill_call("drafter", PREFILL_SHORT, before=evict)
    per_token = max(0.0, (whole - short) / (fed - PREFILL_SHORT))
    fixed = max(0.0, short - PREFILL_SHORT * per_token)
    return per_token / step, fixed / step


@torch.inference_mode()
def measure_costs(
    dec, ids: torch.Tensor, iters: int = 16, memo: CostsMemo | None = None
) -> DraftCosts:
    """The pair's `DraftCosts` on this device (dec: a `SpeculativeDecoder`; p = target,
    q = drafter): the forwards (`time_forwards`) and the round's glue (`round_glue`). ids:
    (B, P), one prompt repeated; B > 1 is timed on the masked, batched path the decoder takes
    there. memo: what other decoders over the same models already measured (costs_memo.py)."""
    if memo is not None and (kept := memo.costs(dec, ids, iters)) is not None:
        return kept
    timings = None if memo is None else memo.forwards(dec, ids, iters)
    if timings is None:
        timings = time_forwards(dec, ids, iters)
        if memo is not None:
            memo.keep_forwards(dec, ids, iters, timings)
    costs = costs_from(dec, ids, timings)
    if memo is not None:
        memo.keep_costs(dec, ids, iters, costs)
    return costs


def costs_from(dec, ids: torch.Tensor, timings: ForwardTimings) -> DraftCosts:
    """`DraftCosts` from the timed forwards, with the round's glue timed in `dec`'s decodes."""
    k, b, parallel = dec.max_draft, ids.shape[0], dec.parallel
    med = timings.ratios
    widths = sorted(int(key[1:]) for key in med if key.startswith("v"))
    v1, vk = med["v1"], med[f"v{k}"]
    per_token = max(0.0, (vk - v1) / (k - 1)) if k > 1 else 0.0
    # what j drafts add to the verify, on the same footing as the line's j * per_token (the
    # 1-draft verify's excess over per_token is in round_overhead): verify_cost(j) is then the
    # timed j-draft verify plus the round's glue at every width
    by_width = len(widths) > 2  # a line through two widths is exact at both
    table = tuple(round(med[f"v{j}"] - v1 + per_token, 4) for j in widths) if by_width else ()
    # the glue at 1 draft and at the most a round drafts (up to 4): a fixed part and a slope
    top = min(k, 4)
    glue = round_glue(dec, ids, sorted({1, top}), timings.step_seconds)
    slope = max(0.0, (glue[top] - glue[1]) / (top - 1)) if top > 1 else 0.0
    costs = DraftCosts(
        c=round(med["d"], 4),
        verify_per_token=round(per_token, 4),
        round_overhead=round(max(MIN_OVERHEAD, v1 - 1.0 - per_token) + glue[1] - slope, 4),
        glue_per_draft=round(slope, 4),
        parallel=parallel,
        draft_per_token=round(max(0.0, (med["dk"] - med["d"]) / (k - 1)), 4)
        if parallel and k > 1
        else 0.0,
        verify_tokens=table,
        prefill_per_token=round(med.get("pq", 0.0), 5),
        prefill_fixed=round(med.get("pf", 0.0), 4),
    )
    if b > 1:  # a batched round's host-side glue grows with the batch: time real rounds
        glue = realized_overhead(dec, ids, costs)
        if glue > costs.round_overhead:
            costs = dataclasses.replace(costs, round_overhead=round(glue, 4))
    return costs


def fixed_length(dec, k: int, tokens: int, prefill_memo=None):
    """A copy of decoder `dec` (same models, vocabulary mapping and settings) that drafts k
    tokens every round, decodes exactly `tokens` tokens (no EOS) and never takes drafts from
    prompt lookup: the decodes the round's overhead is timed in."""
    cfg = dataclasses.replace(
        dec.cfg, draft_length="fixed", gamma=k, max_new_tokens=tokens, eos_token_id=(), lookup=False
    )
    return type(dec)(
        dec.target, dec.drafter, cfg, tokenizer_len=dec.vocab, mapped=dec.mapped,
        prefill_memo=prefill_memo,
    )  # fmt: skip


def round_glue(
    dec, ids: torch.Tensor, ks: list[int], step_seconds: float, tokens: int = 16, reps: int = 2
) -> dict[int, float]:
    """Per k in ks: the host-side time a fixed-length round of k drafts spends beyond its
    forwards, less what a plain target step spends beyond its forward, in target steps
    (step_seconds: one target step's forward). Timed in the decoder's own decodes of `tokens`
    tokens on `ids` (fixed k, no prompt lookup; target-only beside them), each one's wall time
    less the seconds inside its forwards (`ForwardClock`, drafter prefill and catch-ups
    included): the forwards are priced by `measure_costs`' step timings, the glue by this.
    Medians over `reps` after one warm-up; the decodes' tokens are never looked at."""
    fixed = {k: fixed_length(dec, k, tokens, dec.prefill_memo) for k in ks}

    def host(fn) -> tuple[float, int]:
        gen = torch.Generator(device="cpu").manual_seed(0)
        with ForwardClock() as clock:
            t0 = time.perf_counter()
            out = fn(ids, generator=gen)
            wall = time.perf_counter() - t0
        return wall - clock.seconds, max(out.target_forwards, 1)

    glue: dict[int, list[float]] = {k: [] for k in ks}
    for i in range(reps + 1):  # the first pass warms both decoders up
        step_host, steps = host(fixed[ks[0]].baseline)
        for k in ks:
            round_host, rounds = host(fixed[k].generate)
            if i:
                glue[k].append((round_host / rounds - step_host / steps) / step_seconds)
    return {k: statistics.median(v) for k, v in glue.items()}


def realized_overhead(
    dec, ids: torch.Tensor, costs: DraftCosts, k: int = 2, tokens: int = 32
) -> float:
    """A speculative round's overhead beyond its forwards, from whole decodes: fixed-gamma k
    rounds against target-only steps on `ids` (B rows), each decoded twice (the first warms),
    interleaved. Forward timings alone miss the per-row bookkeeping of batched rounds, which on
    CPU made adaptive lengths at batch 4 draft as if rounds were cheap."""
    fixed = fixed_length(dec, k, tokens)  # called at B > 1 only, where lookup never runs
    ratios = []
    for i in range(6):
        t0 = time.perf_counter()
        base = fixed.baseline(ids)
        t1 = time.perf_counter()
        spec = fixed.generate(ids)
        t2 = time.perf_counter()
        if i:
            step = (t1 - t0) / max(base.target_forwards, 1)
            ratios.append((t2 - t1) / max(spec.target_forwards, 1) / step)
    # drafts, verify and the per-draft glue: what is left is the round's fixed overhead
    forwards = costs.round_cost(k) - costs.round_overhead
    return max(0.0, statistics.median(ratios) - forwards)
