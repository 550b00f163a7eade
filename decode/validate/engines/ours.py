"""Our speculative decoder as an engine: the measurement every other engine stands beside.

Target-only against speculative decoding on validate's prompts at the decoder's K, in
interleaved timed repeats after an untimed warm-up, in the serving mode and then the other one;
greedy output checked token-identical to target-only (`lossless`); then this machine's step
costs (c, the verify cost), which price the report's speed figures only. Its report rows are
report.md's figure table: acceptance first (the same on every machine), then this machine's
speed. p = target, q = drafter.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import spread
from specdistill.decode.config import DecoderSettings
from specdistill.decode.draft_length import DraftCosts
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.speculative import SpeculativeDecoder
from specdistill.decode.validate.engines.base import (
    EngineDefaults,
    EngineRun,
    Job,
    Ours,
    ReportPart,
)
from specdistill.decode.validate.loaded import Batch, Setup
from specdistill.decode.validate.mapped import mapped_context
from specdistill.decode.validate.modes import (
    measure_other_mode,
    mode_figures,
    mode_name,
    positions,
    speedup_range,
    speedup_text,
    timed_repeats,
)
from specdistill.decode.validate.modes import run_all as _run_all
from specdistill.decode.validate.target_only import SharedBaseline
from specdistill.decode.validate.timing import round_costs

log = logging.getLogger(__name__)

Make = Callable[..., SpeculativeDecoder]  # make(gamma, settings=job.decoder) -> a decoder

# what the drafter's own alpha reads as when it rests on no drafts (every tested draft was
# prompt lookup's): report.md here and the pipeline's summary
NO_OWN_DRAFTS = "n/a (0 drafts of its own)"


def warm_up(dec: SpeculativeDecoder, batches: Sequence[Batch], warm: Sequence[Batch], seed: int):
    """Untimed: compile every step shape per capacity bucket (compiled steps, batch 1), then one
    baseline and one speculative pass on the warm-up prompt."""
    if dec.compile and all(ids.shape[0] == 1 for ids, _ in batches):
        buckets = {dec.spec_capacity(1, int(m.sum())): ids[:, m[0].bool()] for ids, m in batches}
        for ids in buckets.values():
            dec.warm_up(ids)
    _run_all(dec.baseline, warm, seed)
    _run_all(dec.generate, warm, seed)


def lossless_check(dec: SpeculativeDecoder, base_out, spec_out, dtype, notes: list[str]):
    """(lossless or None when sampling, mismatched sequences): greedy must be token-identical."""
    greedy = dec.cfg.sampling.greedy
    mismatched = sum(a != b for a, b in zip(base_out.tokens, spec_out.tokens))
    if not greedy:
        notes.append("sampling: lossless is distributional (checked by tests), not per token")
    if dec.cfg.lossy:
        notes.append(f"LOSSY: lenience={dec.cfg.lenience} < 1 changes the output distribution")
    if greedy and mismatched and dtype != torch.float32:
        notes.append(f"{mismatched} sequences differ in {dtype}: near-ties, rerun with dtype=fp32")
    return ((mismatched == 0 and not dec.cfg.lossy) if greedy else None), mismatched


def modeled_speedup(out, costs: DraftCosts) -> float:
    """The cost model's speedup over target-only decoding at the decode's own rounds: its tokens
    over what its rounds cost in target steps (each row-round of k drafts costs `round_cost(k)`),
    so a fixed K and an adaptive policy are priced alike (pure)."""
    cost = sum(n * costs.round_cost(k) for k, n in enumerate(out.draft_lengths))
    return out.block_tokens / cost if cost else 1.0


def headline(spec_out, base_rates, spec_rates, c: float, verify_cost: float, costs) -> dict:
    """The serving mode's figures: acceptance first, then this machine's speed."""
    speedup = statistics.median(spec_rates) / statistics.median(base_rates)
    theory = modeled_speedup(spec_out, costs)
    figures = {
        "tau": round(spec_out.tau, 3),
        "acceptance_by_position": spec_out.acceptance_at(),
        "alpha": round(spec_out.alpha, 4),
        "drafter_alpha": round(spec_out.drafter_alpha, 4),
        "drafter_acceptance_by_position": [round(x, 4) for x in spec_out.drafter_alpha_at()],
        "drafter_trials": spec_out.drafter_trials,
        "drafter_trials_by_position": spec_out.drafter_trials_at(),
        "acceptance_rate": round(spec_out.accepted / max(spec_out.trials, 1), 4),
        "mean_draft_length": round(spec_out.mean_draft_length, 3),
        "draft_lengths": list(spec_out.draft_lengths),
        "c": round(c, 4),
        "verify_cost": round(verify_cost, 3),
        "baseline_tokens_per_s": spread(base_rates),
        "speculative_tokens_per_s": spread(spec_rates),
        "speedup": round(speedup, 3),
        "speedup_range": speedup_range(base_rates, spec_rates),
        "theoretical_speedup": round(theory, 3),
        "decoder_efficiency": round(speedup / theory, 3),
    }
    if spec_out.lookup_rounds:  # decoder.lookup: the share of rounds drafted from the context
        figures["lookup"] = {
            "round_share": spec_out.lookup_round_share,
            "acceptance": round(spec_out.lookup_acceptance, 4),
        }
    return figures


def decoder_factory(st: Setup, max_new_tokens: int, default: DecoderSettings) -> Make:
    """make(gamma, settings=default): a decoder on the loaded pair at that gamma."""

    def make(gamma: int, settings: DecoderSettings = default) -> SpeculativeDecoder:
        config = settings.decoder_config(max_new_tokens, st.eos, gamma)
        return SpeculativeDecoder(
            st.target, st.drafter, config, tokenizer_len=len(st.tok), mapped=st.mapped
        )

    return make


@dataclass
class ServingMeasurement:
    """Ours: the serving mode's decoder, gamma and figures (`headline`), both modes' rows, the
    first pass's outputs, this machine's cost model and the decoder factory it used."""

    dec: SpeculativeDecoder
    gamma: int
    figures: dict[str, Any]
    modes: dict[str, dict[str, Any]]
    base_out: DecodeOutput
    spec_out: DecodeOutput
    lossless: bool | None
    mismatched: int
    warmup_seconds: float
    costs: DraftCosts
    make: Make

    def beside(self) -> Ours:
        """What the other engines stand beside."""
        cfg = self.dec.cfg
        greedy = self.base_out.tokens if cfg.sampling.greedy else None
        return Ours(cfg, self.dec.parallel, self.gamma, self.modes, self.figures["speedup"], greedy)


def measure_serving(job: Job, notes: list[str]) -> ServingMeasurement:
    """Warm up untimed, decode target-only against speculative in interleaved timed repeats,
    check losslessness, then time this machine's step costs: the report's headline."""
    st, passes = job.st, job.passes
    t_warm = time.perf_counter()
    gamma = job.decoder.gamma
    make = decoder_factory(st, job.max_new_tokens, job.decoder)
    dec = make(gamma)
    log.info("validate: untimed warm-up, then the timed repeats (%d)", job.repeats)
    warm_up(dec, st.batches, st.warm, job.seed)
    warmup_seconds = time.perf_counter() - t_warm
    mode = mode_name(dec.cfg.sampling.temperature)
    shared = SharedBaseline.open(st.target_only, dec, st.batches, job.seed, job.repeats)
    base_rates, spec_rates, base_out, spec_out = timed_repeats(
        dec,
        st.batches,
        job.seed,
        job.repeats,
        None if passes is None else passes.setdefault(mode, []),
        f"validate {mode}" if job.progress else None,
        shared,
    )
    lossless, mismatched = lossless_check(dec, base_out, spec_out, st.dtype, notes)
    # this machine's step costs at the warm-up prompt: the report's speed figures only
    c, verify, costs = round_costs(dec, st.warm[0][0], job.step_time_iters, gamma)
    if dec.parallel:
        notes.append(f"parallel drafting: c = one drafter forward of {gamma + 1} tokens")
    figures = headline(spec_out, base_rates, spec_rates, c, verify, costs)
    modes = {mode: mode_figures(dec, base_rates, spec_rates, spec_out, shared)}
    return ServingMeasurement(dec, gamma, figures, modes, base_out, spec_out, lossless,
                              mismatched, warmup_seconds, costs, make)  # fmt: skip


def measure_other(job: Job, sv: ServingMeasurement) -> None:
    """The other serving mode on the same prompts and gamma, into `sv.modes` (both serving
    modes, always, unless `both_modes` is off)."""
    if job.other is None:
        return
    passes = job.passes
    other_passes: list = []
    name, other = measure_other_mode(
        lambda ds: sv.make(sv.gamma, ds), job.other, job.st.batches, job.st.warm, job.seed,
        job.repeats, None if passes is None else other_passes, job.progress, job.st.target_only,
    )  # fmt: skip
    sv.modes[name] = other
    if passes is not None:
        passes[name] = other_passes


def _drafter_alpha(r: Mapping[str, Any]) -> str:
    """The drafter's own acceptance with how many drafts it rests on; positions it never
    drafted at read '-' (not 0.00), and no drafts at all reads n/a (not 0.0)."""
    if r.get("drafter_alpha") is None:
        return "n/a"
    if r.get("drafter_trials") == 0:
        return f"{NO_OWN_DRAFTS}: every tested draft was prompt lookup's"
    tested = r.get("drafter_trials_by_position")
    at = " ".join(
        "-" if tested is not None and i < len(tested) and not tested[i] else f"{x:.2f}"
        for i, x in enumerate(r.get("drafter_acceptance_by_position") or [])
    )
    trials = r.get("drafter_trials")
    n = f" ({trials} drafts)" if trials is not None else ""
    return f"{r['drafter_alpha']}{n} / {at}" if at else f"{r['drafter_alpha']}{n}"


def recommended_rows(rec: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """One row per cost model: the recommended K and its modeled speedup, with the K sweep."""
    if not rec:
        return []
    rows = []
    for e in rec["by_cost"]:
        sweep = " ".join(f"{k}:{x}" for k, x in enumerate(e["speedup_by_k"], 1))
        rows.append(
            (
                f"recommended K, {e['label']} (c {e['c']}, verify +{e['verify_per_token']}/draft)",
                f"**{e['k']}** (modeled {e['speedup']}x{'' if e.get('pays', True) else ': no K pays here'}"
                f"; by K {sweep})",
            )
        )
    return rows


class OursEngine(EngineDefaults):
    """Our decoder (`engines=[ours]`, always first); it reads the stage's own settings
    (`decoder`, `other_sampling`, ...); the pipeline's summary reads its figures from
    report.json itself (distill/pipeline/report.py)."""

    name = "ours"

    def preflight(self, cfg: Any, spec: PairSpec, settings: None) -> None:
        """A drafter with its own tokenizer: `decoder.mapped_context` checked before loading."""
        if spec.vocab == "mapped":
            mapped_context(cfg)

    def run(self, job: Job, ready: None) -> EngineRun:
        """Both serving modes in our decoder; the section is its `ServingMeasurement`."""
        notes: list[str] = []
        sv = measure_serving(job, notes)
        measure_other(job, sv)
        return EngineRun(sv, notes)

    def report(self, record: Mapping[str, Any]) -> ReportPart:
        """report.md's figure table (report.json's top-level figures and `modes`)."""
        r = record
        b, s = r["baseline_tokens_per_s"], r["speculative_tokens_per_s"]
        rows = []
        for name, m in r["modes"].items():
            t = "" if name == "greedy" else f", temperature {m.get('temperature')}"
            rows.append((f"tau at K={r['gamma']}, {name}{t}", f"**{m['tau']}**"))
            at = positions(m.get("acceptance_by_position"), m.get("trials_at"))
            rows.append((f"acceptance by draft position, {name}", at))
        rows += [
            ("the drafter's own alpha (its drafts only) / by position", _drafter_alpha(r)),
            ("lossless", f"{r['lossless']}{' (LOSSY lenience)' if r['lossy'] else ''}"),
            ("temperature / top_k / top_p (serving mode)", f"{r['temperature']} / {r['top_k']} / {r['top_p']}"),
            *recommended_rows(r.get("recommended_k")),
            ("machine (speed figures below are this machine's)", r.get("machine") or "n/a"),
            ("device / dtype", f"{r['device']} / {r['dtype']} ({r['cache']} cache{', compiled' if r['compiled'] else ''})"),
            ("c (drafter / target step time)", f"{r['c']}; verify step = {r['verify_cost']} target steps"),
            ("target-only tokens/s", f"{b['median']} (min {b['min']}, max {b['max']})"),
            ("speculative tokens/s", f"{s['median']} (min {s['min']}, max {s['max']})"),
            ("speedup (measured): median (range) of repeats", speedup_text(r["speedup"], r.get("speedup_range"))),
            ("modeled speedup at this machine's c", f"{r['theoretical_speedup']}x (efficiency {r['decoder_efficiency']})"),
            ("untimed warm-up (compile included)", f"{r['warmup_seconds']} s"),
        ]  # fmt: skip
        if r["draft_length"] != "fixed":
            rows.append(
                (
                    f"draft lengths ({r['draft_length']}, at most {r['max_draft']})",
                    f"mean {r['mean_draft_length']}, rounds by drafts 0..: {r['draft_lengths']}",
                )
            )
        if r.get("vocab_mapping"):  # a drafter with its own tokenizer (decode/validate/mapped.py)
            v = r["vocab_mapping"]
            rows.append(
                (
                    f"vocabulary mapping ({v['context']} context)",
                    f"{v['intersection']} of the drafter's {v['draft_vocab']} tokens shared; they "
                    f"cover {v['output_coverage']:.1%} of the target's output tokens",
                )
            )
        return ReportPart(rows, [])


ENGINE = OursEngine()
