"""The validate stage: prove the speedup and that the output stayed the target's.

    python -m specdistill.decode.validate pair=toy-tiny output_dir=DIR
    python -m specdistill.decode.validate pair=toy pair.drafter=/path/to/distilled decoder=sampling

On the same prompts and max_new_tokens it decodes with the target p alone and speculatively
(drafter q proposes, p verifies), untimed warm-up first, `repeats` timed passes interleaved so
load drifts hit both alike, and reports side by side: tokens/s (median, min, max), the measured
speedup, alpha, tau, c (drafter/target step time), the theoretical speedup those imply, their
ratio (decoder efficiency), `lossless` (greedy: every sequence token-identical to target-only),
the same figures in the other serving mode (`modes`: greedy and sampling, both timed; a drafter
tuned for one mode is often poor in the other), and the same pair through `transformers`
assisted generation.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_pair, resolve_pair
from specdistill.data.prompts import check_prompt_settings, fit_prompt_set, load_prompts
from specdistill.data.runtime import (
    ConfigError,
    pad_rows,
    parse_dtype,
    resolve_device,
    run_or_exit,
    set_threads,
    spread,
)
from specdistill.decode.acceptance import expected_tau, theoretical_speedup
from specdistill.decode.cache import check_rollback_config
from specdistill.decode.config import DecoderSettings
from specdistill.decode.draft_length import DraftCosts, draft_figures, modeled_speedup
from specdistill.decode.draft_length.costs_memo import CostsMemo
from specdistill.decode.prefill_memo import PrefillMemo
from specdistill.decode.speculative import SpeculativeDecoder
from specdistill.decode.validate.buckets import measure_buckets, regroup
from specdistill.decode.validate.mapped import check_mapped_stage, load_mapped, mapping_figures
from specdistill.decode.validate.modes import (
    measure_other_mode,
    mode_figures,
    mode_name,
    speedup_range,
    timed_repeats,
)
from specdistill.decode.validate.modes import merge as _merge
from specdistill.decode.validate.modes import run_all as _run_all
from specdistill.decode.validate.report import ValidateResult, plot_acceptance, report_markdown
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.decode.validate.timing import (
    auto_gamma,
    forward_cost,
    hf_assisted_speed,
    measure_c,
)
from specdistill.decode.validate.vllm_engine import preflight

log = logging.getLogger(__name__)


def _batches(rows: list[list[int]], pad_id: int, batch_size: int):
    """Left-padded tensors of already fitted prompt ids."""
    return [pad_rows(rows[i : i + batch_size], pad_id) for i in range(0, len(rows), batch_size)]


@dataclass
class Setup:
    """A loaded pair and its prompts as left-padded batches (shared with decode.bench_modes)."""

    spec: Any
    target: Any
    drafter: Any
    tok: Any
    device: torch.device
    dtype: torch.dtype
    eos: tuple[int, ...]
    texts: list[str]
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    warm: list[tuple[torch.Tensor, torch.Tensor]]
    engines: tuple[str, ...] = ("ours",)
    vllm_settings: Any = None  # EngineSettings when engines include vllm
    # How prompts were fitted to the context: policy, budget, how many were long / truncated /
    # skipped (`fit_prompt_set`); and each kept prompt's context-length bucket (long sets, else None).
    prompt_fit: dict[str, Any] = field(default_factory=dict)
    buckets: list[str | None] = field(default_factory=list)
    mapped: Any = None  # MappedVocab: the drafter has its own tokenizer (decode/validate/mapped.py)


def setup(cfg: DictConfig, gamma_room: int, vs: ValidateSettings | None = None) -> Setup:
    """Check the settings, then load the pair and the prompts (bad input fails before loading).

    `vs`: the stage's settings when the caller typed them already (`run` does, at its top)."""
    vs = vs or ValidateSettings.from_cfg(cfg)  # the stage's and the decoder's checks
    check_prompt_settings(cfg.dataset)
    device = resolve_device(vs.device)
    set_threads(vs.threads, device, prefill=vs.prefill_threads)
    dtype = parse_dtype(vs.dtype, device)
    spec = resolve_pair(cfg.pair, stage="validate", mapped_ok=True)
    for key, name, rev in (
        ("pair.target", spec.target, spec.revision),
        ("pair.drafter", spec.drafter, spec.drafter_revision),
    ):  # refuse an un-rollbackable cache before any weights load
        check_rollback_config(key, name, rev, spec.trust_remote_code)
    engines = vs.engines
    check_mapped_stage(cfg, spec, engines)
    vllm_settings = preflight(cfg, spec) if "vllm" in engines else None
    target, drafter, tok = load_pair(spec, device=device, dtype=dtype)
    mapped = load_mapped(cfg, spec, target, drafter, tok)
    prompts = load_prompts(cfg.dataset, tok, default_split="test")
    if vs.num_prompts:
        prompts = prompts[: vs.num_prompts]
    eos = tuple(sorted({i for i in [tok.eos_token_id] if i is not None}))
    context = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
    room = context - vs.max_new_tokens - gamma_room - 2
    max_prompt = int(vs.max_prompt_tokens or room)
    if max_prompt < 1 or max_prompt > room:
        raise ConfigError(
            f"max_prompt_tokens={max_prompt}: the context ({context}) leaves {room} prompt tokens "
            f"after max_new_tokens={vs.max_new_tokens}; lower max_new_tokens or max_prompt_tokens"
        )
    where = f"the target's {context}-token context leaves after max_new_tokens={vs.max_new_tokens}"
    prompts, rows, fit = fit_prompt_set(prompts, tok, vs.long_prompts, max_prompt, where)
    fit["context"] = context
    texts = [p.text for p in prompts]
    batches = _batches(rows, tok.pad_token_id, vs.batch_size)
    warm = _batches(rows[:1], tok.pad_token_id, 1)
    return Setup(
        spec, target, drafter, tok, device, dtype, eos, texts, batches, warm, engines,
        vllm_settings, prompt_fit=fit, buckets=[p.bucket for p in prompts], mapped=mapped,
    )  # fmt: skip


def warm_up(dec: SpeculativeDecoder, batches, warm, seed: int) -> None:
    """Untimed: compile every step shape per capacity bucket (compiled steps, batch 1), then one
    baseline and one speculative pass on the warm-up prompt."""
    if dec.compile and all(ids.shape[0] == 1 for ids, _ in batches):
        buckets = {dec.spec_capacity(1, int(m.sum())): ids[:, m[0].bool()] for ids, m in batches}
        for ids in buckets.values():
            dec.warm_up(ids)
    _run_all(dec.baseline, warm, seed)
    _run_all(dec.generate, warm, seed)


Make = Callable[..., SpeculativeDecoder]  # make(gamma, settings=vs.decoder) -> a decoder


def choose_gamma(vs: ValidateSettings, st: Setup, make: Make, notes: list[str]):
    """(gamma, decoder, c, verify cost): c and the verify cost measured with the decoder's own
    caches; gamma=auto picks gamma from a pilot run's alpha and c with the speedup model."""
    fixed_gamma, probe = vs.decoder.gamma, st.warm[0][0]
    pilot_gamma, iters = vs.decoder.gamma_or_default, vs.step_time_iters
    c, verify_cost = measure_c(make(pilot_gamma), probe, iters, pilot_gamma)
    gamma = fixed_gamma
    if gamma is None:
        pilot_dec = make(pilot_gamma)
        batches = st.batches[: max(1, len(st.batches) // 4)]
        _, pilot = _run_all(pilot_dec.generate, batches, vs.seed)
        gamma, note = auto_gamma(pilot_dec, probe, _merge(pilot).alpha, c, vs.decoder.max_gamma)
        notes.append(note)
    dec = make(gamma)
    if dec.cfg.draft_length != "fixed":  # the policy's step costs at this batch size (untimed)
        dec.draft_costs(probe, vs.batch_size)
    if fixed_gamma is None:  # the verify cost depends on gamma: measure it for the one picked
        c, verify_cost = measure_c(dec, probe, iters, gamma)
    return gamma, dec, c, verify_cost


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


def headline(
    spec_out, base_rates, spec_rates, gamma: int, c: float, verify_cost: float,
    costs: DraftCosts | None = None,
) -> dict:  # fmt: skip
    """The serving mode's figures: alpha, tau, c, tokens/s, measured and theoretical speedup.
    `costs`: an adaptive policy's step costs; its theoretical speedup is then the cost model's
    at the decode's own draft lengths (`modeled_speedup`), not the fixed-gamma formula's."""
    alpha = min(max(spec_out.alpha, 0.0), 1.0)
    speedup = statistics.median(spec_rates) / statistics.median(base_rates)
    theory = theoretical_speedup(alpha, gamma, c)
    measured_verify = expected_tau(alpha, gamma) / (gamma * c + verify_cost)
    if costs is not None:
        tokens = sum(len(t) for t in spec_out.tokens)
        theory = measured_verify = modeled_speedup(spec_out.draft_lengths, tokens, costs)
    by_pos = [a / t if t else 0.0 for a, t in zip(spec_out.accepted_at, spec_out.trials_at)]
    return {
        "alpha": round(spec_out.alpha, 4),
        "drafter_alpha": round(spec_out.drafter_alpha, 4),
        "drafter_acceptance_by_position": [round(x, 4) for x in spec_out.drafter_alpha_at()],
        "drafter_trials": spec_out.drafter_trials,
        "drafter_trials_by_position": spec_out.drafter_trials_at(),
        "acceptance_rate": round(spec_out.accepted / max(spec_out.trials, 1), 4),
        "tau": round(spec_out.tau, 3),
        "c": round(c, 4),
        "verify_cost": round(verify_cost, 3),
        "baseline_tokens_per_s": spread(base_rates),
        "speculative_tokens_per_s": spread(spec_rates),
        "speedup": round(speedup, 3),
        "speedup_range": speedup_range(base_rates, spec_rates),
        "theoretical_speedup": round(theory, 3),
        "decoder_efficiency": round(speedup / theory, 3),
        "theoretical_speedup_measured_verify": round(measured_verify, 3),
        "acceptance_by_position": [round(x, 4) for x in by_pos],
    }


def settings(vs: ValidateSettings, st: Setup, dec: SpeculativeDecoder, gamma: int) -> dict:
    """What was validated and how: the pair, device, decoder settings, prompt budget."""
    s = dec.cfg.sampling
    return {
        "target": st.spec.target,
        "drafter": st.spec.drafter,
        "device": str(st.device),
        "dtype": str(st.dtype).removeprefix("torch."),
        "gamma": gamma,
        "gamma_auto": vs.decoder.gamma is None,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "lenience": dec.cfg.lenience,
        "lossy": dec.cfg.lossy,
        "batch_size": vs.batch_size,
        "prompts": len(st.texts),
        "max_new_tokens": vs.max_new_tokens,
        "repeats": vs.repeats,
        "cache": "static" if dec.static else "dynamic",
        "compiled": dec.compile,
        "prefill_dtype": dec.cfg.prefill_dtype,
        "draft_length": dec.cfg.draft_length,
        "cpu_linears": {  # decoder.cpu_matmul's choice per model (auto: timed on this machine)
            "target": dec.layout(dec.target).describe(),
            "drafter": dec.layout(dec.drafter).describe(),
        },
    }


def decoder_factory(vs: ValidateSettings, st: Setup) -> Make:
    """make(gamma, settings=vs.decoder): a decoder on the loaded pair at that gamma."""

    memo = PrefillMemo() if vs.prefills_once(any(b is not None for b in st.buckets)) else None
    costs = CostsMemo()  # the pilot's, the serving mode's and the other mode's decoders share it

    def make(gamma: int, settings: DecoderSettings = vs.decoder) -> SpeculativeDecoder:
        config = settings.decoder_config(vs.max_new_tokens, st.eos, gamma)
        return SpeculativeDecoder(
            st.target,
            st.drafter,
            config,
            tokenizer_len=len(st.tok),
            mapped=st.mapped,
            prefill_memo=memo,
            costs_memo=costs,
        )

    return make


@dataclass
class ServingMeasurement:
    """The serving mode's measurement: its decoder, gamma and figures (`headline`), with the
    first pass's outputs and the timed rates the side measurements compare against."""

    dec: SpeculativeDecoder
    gamma: int
    figures: dict[str, Any]
    modes: dict[str, dict[str, Any]]
    base_out: Any
    spec_out: Any
    lossless: bool | None
    mismatched: int
    warmup_seconds: float


def measure_serving(
    vs: ValidateSettings, st: Setup, make: Make, notes: list[str], passes: dict | None = None
) -> ServingMeasurement:
    """Choose gamma (measuring c), warm up untimed, time target-only against speculative
    decoding in interleaved repeats, and check losslessness: the report's headline."""
    t_warm = time.perf_counter()
    log.info(
        "validate: timing the pair's steps on the warm-up prompt (%d tokens)%s",
        st.warm[0][0].shape[1],
        ", then a pilot decode for gamma=auto" if vs.decoder.gamma is None else "",
    )
    gamma, dec, c, verify_cost = choose_gamma(vs, st, make, notes)
    if dec.parallel:  # one drafter forward per round: the formula's gamma c is its cost
        c = forward_cost(dec, st.warm[0][0], gamma + 1, vs.step_time_iters) / gamma
        notes.append(
            f"parallel drafting: c = one drafter forward of gamma+1 tokens / gamma = {c:.3f} "
            "(the theoretical speedup's gamma c is one forward per round)"
        )
    log.info("validate: untimed warm-up, then the timed repeats (%d)", vs.repeats)
    warm_up(dec, st.batches, st.warm, vs.seed)  # untimed, then interleaved timed repeats
    warmup_seconds = time.perf_counter() - t_warm
    mode = mode_name(dec.cfg.sampling.temperature)
    base_rates, spec_rates, base_out, spec_out = timed_repeats(
        dec,
        st.batches,
        vs.seed,
        vs.repeats,
        None if passes is None else passes.setdefault(mode, []),
        f"validate {mode}" if vs.progress else None,
    )
    lossless, mismatched = lossless_check(dec, base_out, spec_out, st.dtype, notes)
    costs = None
    if dec.cfg.draft_length != "fixed":
        costs = dec.draft_costs(st.warm[0][0], vs.batch_size)
    figures = headline(spec_out, base_rates, spec_rates, gamma, c, verify_cost, costs)
    modes = {
        mode_name(dec.cfg.sampling.temperature): mode_figures(dec, base_rates, spec_rates, spec_out)
    }
    return ServingMeasurement(
        dec, gamma, figures, modes, base_out, spec_out, lossless, mismatched, warmup_seconds
    )


def side_measurements(
    vs: ValidateSettings,
    st: Setup,
    make: Make,
    sv: ServingMeasurement,
    notes: list[str],
    passes: dict | None = None,
) -> dict[str, Any]:
    """The other serving mode (into `sv.modes`), fixed gamma beside an adaptive policy,
    `transformers` assisted generation and vLLM, each on the same prompts as the headline."""
    dec, gamma, seed, repeats = sv.dec, sv.gamma, vs.seed, vs.repeats
    if vs.other is not None:  # both serving modes, always (unless turned off), timed too
        other_passes: list = []
        name, other = measure_other_mode(
            lambda ds: make(gamma, ds), vs.other, st.batches, st.warm, seed, repeats,
            None if passes is None else other_passes, vs.progress,
        )  # fmt: skip
        sv.modes[name] = other
        if passes is not None:
            passes[name] = other_passes
    fixed_speedup = None
    if dec.cfg.draft_length != "fixed":  # the policy beside fixed gamma, same interleaving
        fdec = make(gamma, vs.decoder.replace(draft_length="fixed"))
        warm_up(fdec, st.batches, st.warm, seed)
        fb, fs, _, _ = timed_repeats(
            fdec,
            st.batches,
            seed,
            repeats,
            progress=f"validate fixed gamma {gamma}" if vs.progress else None,
        )
        fixed_speedup = round(statistics.median(fs) / statistics.median(fb), 3)
    hf = None
    if vs.hf_assisted:
        log.info("validate: transformers' assisted generation on the same prompts")
        hf = hf_assisted_speed(
            st.target, st.drafter, st.tok, st.warm, st.batches, dec.cfg, repeats, sv.base_out,
            assistant_tokenizer=st.mapped.draft_tokenizer if st.mapped else None,
        )  # fmt: skip
        if hf.get("speedup"):
            hf["ours_over_hf"] = round(sv.figures["speedup"] / hf["speedup"], 3)
    vllm_figures = None
    if st.vllm_settings is not None:  # last: vLLM takes over the process's threads
        vllm_figures = in_vllm(vs, st, dec, gamma, sv.modes, sv.base_out, notes)
    return {"hf_assisted": hf, "fixed_gamma_speedup": fixed_speedup, "vllm": vllm_figures}


def run(cfg: DictConfig) -> ValidateResult:
    """Validate one pair; see the module docstring. Writes report.json and report.md.

    Steps: type the settings, set up the pair and prompts, measure the serving mode
    (`measure_serving`), then the side measurements (`side_measurements`), then the report.
    """
    t_start = time.perf_counter()
    vs = ValidateSettings.from_cfg(cfg)
    st = setup(cfg, vs.gamma_room, vs)
    st, plan = regroup(st, vs.batch_size)  # long prompt sets: batches within one bucket
    # each mode's timed repeats batch by batch, kept only when there are buckets to regroup
    passes: dict[str, list] | None = {} if plan else None
    notes: list[str] = []
    if st.prompt_fit.get("long"):
        fit = st.prompt_fit
        notes.append(f"long_prompts={fit['policy']}: {fit['long']} prompts over "
                     f"{fit['max_prompt_tokens']} tokens")  # fmt: skip
    make = decoder_factory(vs, st)
    sv = measure_serving(vs, st, make, notes, passes)
    side = side_measurements(vs, st, make, sv, notes, passes)
    dec, modes = sv.dec, sv.modes
    by_bucket = None
    if plan:  # per bucket: both modes' figures, c and verify cost timed at its length, KV
        log.info("validate: step costs at each context-length bucket's median prompt")
        by_bucket = measure_buckets(
            plan, st.batches, dec, sv.gamma, vs.step_time_iters, vs.max_new_tokens, passes
        )
    adaptive = dec.cfg.draft_length != "fixed"
    if dec.prefill_memo is not None:
        memo = dec.prefill_memo
        notes.append(
            f"prefill_once: each prompt's prefill ran once per model ({memo.misses} runs, "
            f"{memo.hits} restored); every decode's end-to-end time counts that measured prefill"
        )
    result = ValidateResult(
        output_dir=str(vs.output_dir),
        **settings(vs, st, dec, sv.gamma),
        **sv.figures,
        lossless=sv.lossless,
        mismatched_sequences=sv.mismatched,
        alpha_sampled=(modes.get("sampling") or {}).get("alpha"),
        tau_sampled=(modes.get("sampling") or {}).get("tau"),
        modes=modes,
        warmup_seconds=round(sv.warmup_seconds, 1),
        notes=notes,
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        draft_figures=draft_figures(
            sv.spec_out, dec.draft_costs(st.warm[0][0], vs.batch_size) if adaptive else None
        )
        | {"max_draft": dec.max_draft},
        engines=list(st.engines),
        prompt_fit=st.prompt_fit,
        vocab_mapping=mapping_figures(st.mapped, sv.base_out.tokens),
        buckets=by_bucket,
        **side,
    )
    result.wall_seconds = round(time.perf_counter() - t_start, 1)
    atomic_write_json(vs.output_dir / "report.json", result)
    atomic_write_text(vs.output_dir / "report.md", report_markdown(result))
    if vs.plot:
        plot_acceptance(sv.figures["acceptance_by_position"], vs.output_dir / "report.png", notes)
    return result


def in_vllm(
    vs: ValidateSettings, st: Setup, dec: SpeculativeDecoder, gamma: int, modes, base_out, notes
):
    """vLLM's side of the report: the same prompts and modes, the target plain and with q."""
    from specdistill.decode.validate.two_engines import validate_in_vllm

    samplings = {mode_name(s.temperature): s for s in vs.samplings}
    if dec.cfg.draft_length != "fixed":
        notes.append(
            f"vLLM drafts a fixed gamma={gamma}; ours used draft_length={dec.cfg.draft_length}"
        )
    if dec.cfg.lossy:
        notes.append("vLLM verifies losslessly; ours used a lossy lenience: acceptance differs")
    figures, more = validate_in_vllm(
        st.spec, st.vllm_settings, st.target.config, st.batches, samplings, modes,
        base_out.tokens if dec.cfg.sampling.greedy else None,
        gamma=gamma, max_new_tokens=vs.max_new_tokens, repeats=vs.repeats,
        seed=vs.seed, dtype=st.dtype, eos=st.eos,
        draft_sample_method=vs.vllm_draft_sample_method,
        parallel_drafting=dec.cfg.drafting == "parallel", mapped=st.mapped,
    )  # fmt: skip
    notes.extend(more)
    return figures


@hydra.main(config_path="pkg://specdistill.conf", config_name="validate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """CLI: bad input is one clean line on stderr and exit status 2, not a traceback."""
    r = run_or_exit(run, cfg)
    print(
        f"speedup {r.speedup}x (theoretical {r.theoretical_speedup}x, efficiency "
        f"{r.decoder_efficiency}); alpha {r.alpha}, tau {r.tau}, c {r.c}, gamma {r.gamma}, "
        f"lossless {r.lossless}: {r.output_dir}/report.json"
    )


if __name__ == "__main__":
    main()
