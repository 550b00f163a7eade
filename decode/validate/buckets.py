"""Validate by context-length bucket: every figure of the report, per bucket.

p = target, q = drafter, c = drafter step / target step. A long-context prompt set tags each
prompt with its bucket (`0-512`, `512-2k`, ...). Step costs grow with the context and acceptance
may fall, so one average over short and long prompts says little: each bucket gets its prompt
lengths; tau, acceptance by position and alpha (the drafter's own apart from prompt lookup's)
in both modes and the measured speedup, all from validate's own timed repeats (no extra
decoding); c and the verify cost timed at its median-length prompt, with the cost model's
speedup there; and the KV-cache memory at its longest prompt + max_new_tokens (`KV_FORMULA`).
The aggregation is pure; `measure_buckets` is the stage's one call.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.runtime import pad_rows, spread
from specdistill.decode.cache_layers import KV_FORMULA, kv_cache_bytes
from specdistill.decode.draft_length import costs_from_steps, speedup_at
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.validate.modes import TimedPass, merge, speedup_range, speedup_text
from specdistill.decode.validate.timing import round_costs


@dataclass(frozen=True)
class BucketPlan:
    """Which batches hold which bucket's prompts (no batch crosses a bucket)."""

    names: tuple[str, ...]  # buckets in the prompt set's order
    of_batch: tuple[str, ...]  # each batch's bucket
    tokens: dict[str, list[int]]  # each bucket's prompt lengths, as decoded

    def batches_of(self, name: str) -> list[int]:
        return [i for i, b in enumerate(self.of_batch) if b == name]


# ----------------------------------------------------------------------------- grouping


def _rows(batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    """Each prompt's ids without its left padding, in batch order."""
    return [ids[j, mask[j].bool()].tolist() for ids, mask in batches for j in range(ids.shape[0])]


def group_batches(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    buckets: Sequence[str | None],
    pad_id: int,
    batch_size: int,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int], BucketPlan] | None:
    """Batches that never mix buckets (so a batch's time belongs to one), the prompts' new order,
    and the plan; None when the prompts carry no buckets. Pure batches stay as they are."""
    if not buckets or any(b is None for b in buckets):
        return None
    rows = _rows(batches)
    names = tuple(dict.fromkeys(b for b in buckets if b is not None))
    order = list(range(len(rows)))
    sizes = [int(ids.shape[0]) for ids, _ in batches]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    mixed = any(len({buckets[s + j] for j in range(n)}) > 1 for s, n in zip(starts, sizes))
    if mixed:
        order = sorted(order, key=lambda i: names.index(buckets[i]))  # type: ignore[arg-type]
        batches, sizes = [], []
        for name in names:
            mine = [i for i in order if buckets[i] == name]
            for k in range(0, len(mine), batch_size):
                part = mine[k : k + batch_size]
                batches.append(pad_rows([rows[i] for i in part], pad_id))
                sizes.append(len(part))
    of_batch, seen = [], 0
    for n in sizes:
        of_batch.append(str(buckets[order[seen]]))
        seen += n
    tokens = {name: [len(rows[i]) for i in order if buckets[i] == name] for name in names}
    return batches, order, BucketPlan(names, tuple(of_batch), tokens)


def regroup(st: Any, batch_size: int) -> tuple[Any, BucketPlan | None]:
    """The validate `Setup` with bucket-pure batches (texts and buckets reordered alike), and
    its plan; (st, None) when its prompts have no buckets."""
    grouped = group_batches(st.batches, st.buckets, st.tok.pad_token_id, batch_size)
    if grouped is None:
        return st, None
    batches, order, plan = grouped
    st = dataclasses.replace(
        st,
        batches=batches,
        texts=[st.texts[i] for i in order],
        buckets=[st.buckets[i] for i in order],
        categories=[st.categories[i] for i in order] if st.categories else st.categories,
    )
    return st, plan


# ----------------------------------------------------------------------------- aggregation


def _rate(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


def bucket_mode_figures(
    idx: Sequence[int], passes: Sequence[TimedPass], greedy: bool
) -> dict[str, Any]:
    """One serving mode's figures over the batches `idx` of each timed repeat (pure), read as
    the headline's: the speedup's median over repeats, acceptance and `lossless` from the first."""
    base, spec = [], []
    for p in passes:
        bo, so = [p.base_outs[i] for i in idx], [p.spec_outs[i] for i in idx]
        tb, ts = sum(p.base_seconds[i] for i in idx), sum(p.spec_seconds[i] for i in idx)
        base.append(_rate(emitted_tokens(bo), tb))
        spec.append(_rate(emitted_tokens(so), ts))
    first = passes[0]
    spec_out = merge([first.spec_outs[i] for i in idx])
    base_out = merge([first.base_outs[i] for i in idx])
    same = base_out.tokens == spec_out.tokens
    lookup = {}
    if spec_out.lookup_rounds:  # decoder.lookup: the share of rounds drafted from the context
        lookup = {
            "lookup_round_share": spec_out.lookup_round_share,
            "lookup_acceptance": round(spec_out.lookup_acceptance, 4),
        }
    return {
        **lookup,
        "tau": round(spec_out.tau, 3),
        "acceptance_by_position": spec_out.acceptance_at(),
        "alpha": round(spec_out.alpha, 4),
        # apart from prompt lookup's, which dominate on long prompts that repeat themselves
        "drafter_alpha": round(spec_out.drafter_alpha, 4),
        "drafter_trials": spec_out.drafter_trials,
        "speedup": round(statistics.median(spec) / statistics.median(base), 3),
        "speedup_range": speedup_range(base, spec),
        "baseline_tokens_per_s": spread(base),
        "speculative_tokens_per_s": spread(spec),
        "lossless": same if greedy else None,
    }


def with_theory(fig: dict[str, Any], gamma: int, c: float, verify_cost: float) -> dict[str, Any]:
    """A mode's bucket figures plus the speedup the cost model gives at the bucket's c and verify
    cost with its acceptance by position (pure)."""
    accept = (fig["acceptance_by_position"] + [0.0] * gamma)[:gamma]
    return fig | {
        "modeled_speedup": round(
            speedup_at(accept, gamma, costs_from_steps(c, verify_cost, gamma)), 3
        )
    }


def kv_memory(
    target_config, drafter_config, tokens: int, target_dtype, drafter_dtype, skipped: int = 0
) -> dict:
    """KV-cache bytes of p and q holding `tokens` slots (one row), from their configs; q holds
    `skipped` fewer (the prompt slots `decoder.drafter_context` leaves it unread)."""
    return {
        "tokens": tokens,
        "drafter_tokens": tokens - skipped,
        "target_bytes": kv_cache_bytes(target_config, tokens, target_dtype),
        "drafter_bytes": kv_cache_bytes(drafter_config, tokens - skipped, drafter_dtype),
    }


# ----------------------------------------------------------------------------- measuring


def probe_prompt(batches, idx: Sequence[int]) -> torch.Tensor:
    """(1, P): the bucket's median-length prompt (the lower median), unpadded."""
    rows = sorted(_rows([batches[i] for i in idx]), key=len)
    return torch.tensor([rows[(len(rows) - 1) // 2]])


def bucket_costs(dec, probe: torch.Tensor, iters: int, gamma: int) -> tuple[float, float]:
    """(c, verify cost) at the probe's context length, timed as the headline's; a parallel
    drafter's c is one forward of gamma+1 tokens / gamma."""
    c, verify, _ = round_costs(dec, probe, iters, gamma, dec.spec_slots(1, probe.shape[1]))
    return (c / gamma if dec.parallel else c), verify


def measure_buckets(
    plan: BucketPlan,
    batches,
    dec,
    gamma: int,
    iters: int,
    max_new_tokens: int,
    passes: dict[str, list[TimedPass]],
) -> list[dict[str, Any]]:
    """report.json's `buckets`, one row per bucket, from `passes` (each mode's timed repeats,
    batch by batch); c and the verify cost are timed here."""
    target, drafter = dec.target, dec.drafter
    rows = []
    for name in plan.names:
        idx = plan.batches_of(name)
        tokens = plan.tokens[name]
        probe = probe_prompt(batches, idx)
        c, verify = bucket_costs(dec, probe, iters, gamma)
        modes = {
            mode: with_theory(bucket_mode_figures(idx, ps, mode == "greedy"), gamma, c, verify)
            for mode, ps in passes.items()
        }
        longest = max(tokens)
        kv = kv_memory(
            target.config, drafter.config, longest + max_new_tokens, target.dtype, drafter.dtype,
            dec.drafter_cut(longest),
        )  # fmt: skip
        rows.append(
            {
                "bucket": name,
                "prompts": len(tokens),
                "mean_prompt_tokens": round(statistics.fmean(tokens), 1),
                "max_prompt_tokens": max(tokens),
                "probe_tokens": int(probe.shape[1]),
                "c": round(c, 4),
                "verify_cost": round(verify, 3),
                "kv_cache": kv,
                "modes": modes,
            }
        )
    return rows


# ----------------------------------------------------------------------------- markdown


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _kv_tokens(kv: dict[str, Any]) -> str:
    """Slots held: one count, or target / drafter where the drafter reads less of the prompt."""
    d = kv.get("drafter_tokens", kv["tokens"])
    return str(kv["tokens"]) if d == kv["tokens"] else f"{kv['tokens']} / {d}"


def drafter_alpha_text(mode: dict[str, Any]) -> str:
    """`0.53 (64)`: the drafter's own acceptance and its tested drafts; `n/a (0)` when every
    round was prompt lookup's (no measurement, not a failing drafter); `n/a` without the figure."""
    alpha, trials = mode.get("drafter_alpha"), mode.get("drafter_trials")
    if alpha is None or trials is None:
        return "n/a"
    return f"n/a ({trials})" if trials == 0 else f"{alpha:.3g} ({trials})"


def bucket_markdown(rows: list[dict[str, Any]] | None) -> list[str]:
    """report.md's per-bucket table: one row per bucket and serving mode."""
    if not rows:
        return []
    lines = [
        "",
        "## By context-length bucket",
        "",
        "| bucket | mode | prompts | mean prompt tokens | tau | acceptance by position | "
        "the drafter's own alpha (drafts) | c | verify cost | speedup (range of repeats) | "
        "modeled | KV MiB, target / drafter (tokens) | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = r["kv_cache"]
        for mode, m in r["modes"].items():
            lossless = "" if m["lossless"] is None else str(m["lossless"])
            at = " ".join(f"{x:.2f}" for x in m.get("acceptance_by_position", []))
            lines.append(
                f"| {r['bucket']} | {mode} | {r['prompts']} | {r['mean_prompt_tokens']} | "
                f"{m['tau']} | {at} | {drafter_alpha_text(m)} | {r['c']} | {r['verify_cost']} | "
                f"{speedup_text(m['speedup'], m.get('speedup_range'))} | "
                f"{m['modeled_speedup']}x | {_mib(kv['target_bytes'])} / "
                f"{_mib(kv['drafter_bytes'])} ({_kv_tokens(kv)}) | {lossless} |"
            )
    lines += [
        "",
        "c and the verify cost (in target steps) are timed at each bucket's median-length "
        "prompt on this machine; modeled: the cost model's speedup at them; KV: one row at the "
        f"bucket's longest prompt + max_new_tokens, {KV_FORMULA}.",
    ]
    return lines
