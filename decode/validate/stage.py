"""The validate stage: what a drafter is worth at the engines' K, and that the output stayed p's.

    python -m specdistill.decode.validate pair=toy-tiny output_dir=DIR
    python -m specdistill.decode.validate pair=toy pair.drafter=/path/to/distilled decoder=sampling

On the same prompts it decodes with the target p alone and speculatively (drafter q proposes, p
verifies) at the decoder's K, in both serving modes. The figures of record need no clock and
are the same on every machine: tau, acceptance by draft position, alpha (the drafter's own apart
from prompt lookup's) and `lossless` (greedy: token-identical to target-only). Then speed,
stated for what it is: this machine's measured speedup, the cost model's speedup at this
machine's c and at a user's `cost_model`, the K that maximises it (export writes it as the
engines' setting), and the same pair through `transformers` assisted generation and vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.dataset_files import check_files
from specdistill.data.heldout_check import check_disjoint
from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_pair, resolve_pair
from specdistill.data.prompts import check_prompt_settings, fit_prompt_set, load_prompts
from specdistill.data.runtime import (
    ConfigError,
    node_get,
    pad_rows,
    parse_dtype,
    resolve_device,
    run_or_exit,
    set_threads,
    spread,
)
from specdistill.data.splits import EVAL
from specdistill.data.stage_config import check_command_line
from specdistill.decode.cache import check_rollback_config
from specdistill.decode.config import DecoderSettings
from specdistill.decode.draft_length import DraftCosts, recommend_k, speedup_table
from specdistill.decode.speculative import SpeculativeDecoder
from specdistill.decode.validate.buckets import measure_buckets, regroup
from specdistill.decode.validate.categories import category_rows, plot_by_category
from specdistill.decode.validate.categories import labels as category_labels
from specdistill.decode.validate.llamacpp_engine import preflight as llamacpp_preflight
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
from specdistill.decode.validate.settings import CostModel, ValidateSettings, removed_keys
from specdistill.decode.validate.target_only import (
    SharedBaseline,
    TargetOnlyCache,
    shared_answers,
)
from specdistill.decode.validate.timing import (
    hf_assisted_speed,
    machine_name,
    round_costs,
)
from specdistill.decode.validate.turns import expand_turns, greedy_answers, merge_fit
from specdistill.decode.validate.vllm_engine import preflight

log = logging.getLogger(__name__)


def by_length(prompts: list, rows: list[list[int]]) -> tuple[list, list[list[int]]]:
    """Prompts and their ids in order of length (ties keep the set's order), so a batch holds
    prompts of similar length: a left-padded batch runs every row at its longest prompt's
    length (prefill included), and a speculative batch runs until its slowest row is done."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    return [prompts[i] for i in order], [rows[i] for i in order]


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
    llamacpp_binary: Any = None  # llama-server's path when engines include llamacpp
    # How prompts were fitted to the context: policy, budget, how many were long / truncated /
    # skipped (`fit_prompt_set`); and each kept prompt's context-length bucket (long sets, else None).
    prompt_fit: dict[str, Any] = field(default_factory=dict)
    buckets: list[str | None] = field(default_factory=list)
    mapped: Any = None  # MappedVocab: the drafter has its own tokenizer (decode/validate/mapped.py)
    # chat benchmarks: each prompt's (set, category) (decode/validate/categories.py), else None
    categories: list[tuple[str, str]] | None = None
    # the run's shared target-only side (decode/validate/target_only.py), else None
    target_only: TargetOnlyCache | None = None


def setup(cfg: DictConfig, gamma_room: int, vs: ValidateSettings | None = None) -> Setup:
    """Check the settings, then load the pair and the prompts (bad input fails before loading).

    `vs`: the stage's settings when the caller typed them already (`run` does, at its top)."""
    vs = vs or ValidateSettings.from_cfg(cfg)  # the stage's and the decoder's checks
    check_prompt_settings(cfg.dataset)
    check_files(cfg.dataset, EVAL)  # the prompt files, before the pair loads to read them
    device = resolve_device(vs.device)
    set_threads(vs.threads, device)
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
    binary = llamacpp_preflight(vs.llamacpp, spec) if vs.llamacpp is not None else None
    cache = None
    if vs.target_only_cache is not None:  # a folder it cannot write fails here, not after decoding
        cache = TargetOnlyCache.create(
            vs.target_only_cache, spec.target, spec.revision, device, dtype, machine_name(device)
        )
    target, drafter, tok = load_pair(spec, device=device, dtype=dtype)
    mapped = load_mapped(cfg, spec, target, drafter, tok)
    prompts = load_prompts(cfg.dataset, tok, default_split=EVAL, target=spec.target)
    if vs.num_prompts:
        prompts = prompts[: vs.num_prompts]
    check_disjoint(prompts, vs.training_data)
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

    def fit_set(ps: list) -> tuple:
        return fit_prompt_set(ps, tok, vs.long_prompts, max_prompt, where)

    prompts, rows, fit = fit_set(prompts)
    # a multi-turn question's later turns, after the target's own greedy answers
    answer = shared_answers(
        cache,
        greedy_answers(target, tok, device, vs.max_new_tokens, eos),
        {"max_new_tokens": vs.max_new_tokens, "eos": list(eos)},
    )
    prompts, rows, turns = expand_turns(prompts, rows, tok, answer, fit_set)
    fit = merge_fit(fit, turns["later_fit"])
    if len(turns["turns"]) > 1:
        fit["turns"] = turns["turns"]
    fit["context"] = context
    warm = _batches(rows[:1], tok.pad_token_id, 1)  # the set's first prompt, however batched
    if vs.batch_size > 1:
        prompts, rows = by_length(prompts, rows)
    texts = [p.text for p in prompts]
    batches = _batches(rows, tok.pad_token_id, vs.batch_size)
    return Setup(
        spec, target, drafter, tok, device, dtype, eos, texts, batches, warm, engines,
        vllm_settings, binary, prompt_fit=fit, buckets=[p.bucket for p in prompts], mapped=mapped,
        categories=category_labels(prompts, node_get(cfg.dataset, "label") or "dataset"),
        target_only=cache,
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


def settings(vs: ValidateSettings, st: Setup, dec: SpeculativeDecoder, gamma: int) -> dict:
    """What was validated and how: the pair, device, decoder settings, prompt budget."""
    s = dec.cfg.sampling
    return {
        "target": st.spec.target,
        "drafter": st.spec.drafter,
        "device": str(st.device),
        "machine": machine_name(st.device),
        "dtype": str(st.dtype).removeprefix("torch."),
        "gamma": gamma,
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
        "draft_length": dec.cfg.draft_length,
    }


def decoder_factory(vs: ValidateSettings, st: Setup) -> Make:
    """make(gamma, settings=vs.decoder): a decoder on the loaded pair at that gamma."""

    def make(gamma: int, settings: DecoderSettings = vs.decoder) -> SpeculativeDecoder:
        config = settings.decoder_config(vs.max_new_tokens, st.eos, gamma)
        return SpeculativeDecoder(
            st.target, st.drafter, config, tokenizer_len=len(st.tok), mapped=st.mapped
        )

    return make


@dataclass
class ServingMeasurement:
    """The serving mode's measurement: its decoder, gamma and figures (`headline`), with the
    first pass's outputs and this machine's cost model."""

    dec: SpeculativeDecoder
    gamma: int
    figures: dict[str, Any]
    modes: dict[str, dict[str, Any]]
    base_out: Any
    spec_out: Any
    lossless: bool | None
    mismatched: int
    warmup_seconds: float
    costs: DraftCosts


def measure_serving(
    vs: ValidateSettings, st: Setup, make: Make, notes: list[str], passes: dict | None = None
) -> ServingMeasurement:
    """Warm up untimed, decode target-only against speculative in interleaved timed repeats,
    check losslessness, then time this machine's step costs: the report's headline."""
    t_warm = time.perf_counter()
    gamma = vs.decoder.gamma
    dec = make(gamma)
    log.info("validate: untimed warm-up, then the timed repeats (%d)", vs.repeats)
    warm_up(dec, st.batches, st.warm, vs.seed)
    warmup_seconds = time.perf_counter() - t_warm
    mode = mode_name(dec.cfg.sampling.temperature)
    shared = SharedBaseline.open(st.target_only, dec, st.batches, vs.seed, vs.repeats)
    base_rates, spec_rates, base_out, spec_out = timed_repeats(
        dec,
        st.batches,
        vs.seed,
        vs.repeats,
        None if passes is None else passes.setdefault(mode, []),
        f"validate {mode}" if vs.progress else None,
        shared,
    )
    lossless, mismatched = lossless_check(dec, base_out, spec_out, st.dtype, notes)
    # this machine's step costs at the warm-up prompt: the report's speed figures only
    c, verify, costs = round_costs(dec, st.warm[0][0], vs.step_time_iters, gamma)
    if dec.parallel:
        notes.append(f"parallel drafting: c = one drafter forward of {gamma + 1} tokens")
    figures = headline(spec_out, base_rates, spec_rates, c, verify, costs)
    modes = {mode: mode_figures(dec, base_rates, spec_rates, spec_out, shared)}
    return ServingMeasurement(
        dec, gamma, figures, modes, base_out, spec_out, lossless, mismatched, warmup_seconds, costs
    )


def side_measurements(
    vs: ValidateSettings,
    st: Setup,
    make: Make,
    sv: ServingMeasurement,
    notes: list[str],
    passes: dict | None = None,
) -> dict[str, Any]:
    """The other serving mode (into `sv.modes`), `transformers` assisted generation and vLLM,
    each on the same prompts as the headline."""
    dec, gamma, seed, repeats = sv.dec, sv.gamma, vs.seed, vs.repeats
    if vs.other is not None:  # both serving modes, always (unless turned off)
        other_passes: list = []
        name, other = measure_other_mode(
            lambda ds: make(gamma, ds), vs.other, st.batches, st.warm, seed, repeats,
            None if passes is None else other_passes, vs.progress, st.target_only,
        )  # fmt: skip
        sv.modes[name] = other
        if passes is not None:
            passes[name] = other_passes
    hf = None
    if vs.hf_assisted:
        log.info("validate: transformers' assisted generation on the same prompts")
        hf = hf_assisted_speed(
            st.target, st.drafter, st.tok, st.warm, st.batches, dec.cfg, repeats, sv.base_out,
            assistant_tokenizer=st.mapped.draft_tokenizer if st.mapped else None,
        )  # fmt: skip
        if hf.get("speedup"):
            hf["ours_over_hf"] = round(sv.figures["speedup"] / hf["speedup"], 3)
    llamacpp_figures = None
    if st.llamacpp_binary is not None:
        llamacpp_figures = in_llamacpp(vs, st, dec, gamma, sv.modes, sv.base_out, notes)
    vllm_figures = None
    if st.vllm_settings is not None:  # last: vLLM takes over the process's threads
        vllm_figures = in_vllm(vs, st, dec, gamma, sv.modes, sv.base_out, notes)
    return {"hf_assisted": hf, "vllm": vllm_figures, "llamacpp": llamacpp_figures}


def recommendation(
    vs: ValidateSettings, st: Setup, make: Make, sv: ServingMeasurement, machine: str
) -> dict[str, Any] | None:
    """The K that maximises the cost model's speedup, from acceptance by position up to
    `recommend_max_k` (the headline's decode when its K reaches that far, else one untimed
    decode at that K: acceptance at a position barely depends on the drafts after it), priced
    at this machine's costs and at each of `cost_model`'s."""
    top = vs.recommend_max_k
    if not top:
        return None
    accept, source = sv.figures["acceptance_by_position"], f"the serving decode (K={sv.gamma})"
    if top > len(accept):
        log.info("validate: acceptance by position up to K=%d for the recommended K", top)
        probe = make(top, vs.decoder.replace(draft_length="fixed", lookup=False))
        _, outs = _run_all(probe.generate, st.batches, vs.seed)
        accept, source = _merge(outs).acceptance_at(), f"an untimed decode at K={top}"
    accept = accept[:top]
    entries = [CostModel(f"this machine ({machine})", vs.batch_size, sv.costs), *vs.cost_model]
    out = []
    for e in entries:
        costs = dataclasses.replace(e.costs, parallel=sv.dec.parallel)
        k, speed = recommend_k(accept, costs)
        out.append(
            {
                "label": e.label,
                "batch": e.batch,
                "c": round(costs.c, 4),
                "verify_per_token": round(costs.verify_per_token, 4),
                "k": k,
                "speedup": round(speed, 3),
                "pays": speed > 1.0,  # False: no K beats target-only decoding at these costs
                "speedup_by_k": speedup_table(accept, costs),
            }
        )
    return {"max_k": top, "acceptance_by_position": accept, "source": source, "by_cost": out}


def run(cfg: DictConfig) -> ValidateResult:
    """Validate one pair (see the module docstring); writes report.json and report.md."""
    t_start = time.perf_counter()
    vs = ValidateSettings.from_cfg(cfg)
    st = setup(cfg, vs.gamma_room, vs)
    st, plan = regroup(st, vs.batch_size)  # long prompt sets: batches within one bucket
    # each mode's timed repeats batch by batch, kept only when there are buckets to regroup
    passes: dict[str, list] | None = {} if plan or st.categories else None
    notes: list[str] = []
    if st.prompt_fit.get("long"):
        fit = st.prompt_fit
        notes.append(f"long_prompts={fit['policy']}: {fit['long']} prompts over "
                     f"{fit['max_prompt_tokens']} tokens")  # fmt: skip
    make = decoder_factory(vs, st)
    sv = measure_serving(vs, st, make, notes, passes)
    side = side_measurements(vs, st, make, sv, notes, passes)
    dec, modes = sv.dec, sv.modes
    reused = [m for m, f in modes.items() if f.get("baseline_reused")]
    if reused and st.target_only is not None:
        notes.append(
            f"{' and '.join(reused)}: target-only tokens and timing from another validate step "
            f"of this run, same prompts and machine ({st.target_only.folder})"
        )
    by_bucket = None
    if plan:  # per bucket: both modes' figures, c and verify cost timed at its length, KV
        log.info("validate: step costs at each context-length bucket's median prompt")
        by_bucket = measure_buckets(
            plan, st.batches, dec, sv.gamma, vs.step_time_iters, vs.max_new_tokens, passes
        )
    info = settings(vs, st, dec, sv.gamma)
    by_category = category_rows(st.categories, passes) if st.categories and passes else None
    recommended = recommendation(vs, st, make, sv, info["machine"])
    result = ValidateResult(
        output_dir=str(vs.output_dir),
        **info,
        **sv.figures,
        lossless=sv.lossless,
        mismatched_sequences=sv.mismatched,
        alpha_sampled=(modes.get("sampling") or {}).get("alpha"),
        tau_sampled=(modes.get("sampling") or {}).get("tau"),
        modes=modes,
        warmup_seconds=round(sv.warmup_seconds, 1),
        notes=notes,
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        max_draft=dec.max_draft,
        recommended_k=recommended,
        engines=list(st.engines),
        prompt_fit=st.prompt_fit,
        vocab_mapping=mapping_figures(st.mapped, sv.base_out.tokens),
        buckets=by_bucket,
        categories=by_category,
        **side,
    )
    result.wall_seconds = round(time.perf_counter() - t_start, 1)
    atomic_write_json(vs.output_dir / "report.json", result)
    atomic_write_text(vs.output_dir / "report.md", report_markdown(result))
    if vs.plot:
        plot_acceptance(modes, vs.output_dir / "report.png", notes)
        name = Path(str(st.spec.drafter)).name
        plot_by_category([(name, by_category or [])], vs.output_dir / "report_categories.png")
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


def in_llamacpp(
    vs: ValidateSettings, st: Setup, dec: SpeculativeDecoder, gamma: int, modes, base_out, notes
):
    """llama.cpp's side of the report: the same prompts and modes in llama-server, the target
    plain and with q written as GGUF (decode/validate/llamacpp_engine.py)."""
    from specdistill.decode.validate.llamacpp_engine import validate_in_llamacpp

    log.info("validate: the pair in llama.cpp's llama-server on the same prompts")
    samplings = {mode_name(s.temperature): s for s in vs.samplings}
    if dec.cfg.draft_length != "fixed":
        notes.append(
            f"llama.cpp drafts up to a fixed K={gamma}; ours used draft_length={dec.cfg.draft_length}"
        )
    if dec.cfg.lossy:
        notes.append(
            "llama.cpp verifies losslessly; ours used a lossy lenience: acceptance differs"
        )
    if dec.cfg.lookup:
        notes.append("llama.cpp drafts with the drafter alone; ours also by prompt lookup")
    if dec.parallel:
        notes.append("llama.cpp runs the parallel drafter autoregressively (one token a forward)")
    figures, more = validate_in_llamacpp(
        vs.llamacpp, st.llamacpp_binary, st, samplings, modes,
        base_out.tokens if dec.cfg.sampling.greedy else None,
        gamma=gamma, max_new_tokens=vs.max_new_tokens, repeats=vs.repeats, seed=vs.seed,
        threads=torch.get_num_threads(), output_dir=vs.output_dir,
    )  # fmt: skip
    notes.extend(more)
    return figures


@hydra.main(config_path="pkg://specdistill.conf", config_name="validate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """CLI: bad input is one clean line on stderr and exit status 2, not a traceback."""
    r = run_or_exit(run, cfg)
    at = " ".join(f"{x:.2f}" for x in r.acceptance_by_position)
    rec = (r.recommended_k or {}).get("by_cost") or []
    k = f"; recommended K {rec[0]['k']} at c {rec[0]['c']}" if rec else ""
    print(
        f"tau {r.tau} at K={r.gamma} (temperature 1: {r.tau_sampled}), acceptance by position "
        f"{at}, lossless {r.lossless}{k}; this machine: speedup {r.speedup}x (modeled "
        f"{r.theoretical_speedup}x at c {r.c}): {r.output_dir}/report.json"
    )


def main() -> None:
    """`python -m specdistill.decode.validate`: a removed or unknown key on the command line is
    one `error:` line (exit 2) before Hydra composes the config, then Hydra's main runs it."""
    check_command_line("validate", removed_keys())
    _hydra_main()


if __name__ == "__main__":
    main()
