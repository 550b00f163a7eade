"""The validate stage's outputs: what report.json holds (ValidateResult) and how a reader takes
one serving mode's figure from it (mode_value), report.md (a side-by-side table) and report.png
(acceptance by draft position). p = target, q = drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.decode.validate.buckets import bucket_markdown
from specdistill.decode.validate.modes import speedup_text


@dataclass
class ValidateResult:
    """Everything report.json holds; p = target, q = drafter."""

    output_dir: str
    target: str
    drafter: str
    device: str
    dtype: str
    gamma: int
    gamma_auto: bool
    temperature: float
    top_k: int
    top_p: float
    lenience: float
    lossy: bool
    batch_size: int
    prompts: int
    max_new_tokens: int
    repeats: int
    alpha: float
    acceptance_rate: float
    tau: float
    c: float
    verify_cost: float  # (gamma+1)-token verify / 1-token target step
    baseline_tokens_per_s: dict[str, float]
    speculative_tokens_per_s: dict[str, float]
    speedup: float
    theoretical_speedup: float
    decoder_efficiency: float
    # The same model with the measured verify cost instead of 1 target step: on CPU a
    # (gamma+1)-token verify is dearer than one step, which the classic formula ignores.
    theoretical_speedup_measured_verify: float
    lossless: bool | None
    mismatched_sequences: int
    acceptance_by_position: list[float]
    # [lowest, highest] per-repeat speedup (each repeat's own target-only pass); None in reports
    # written before it existed
    speedup_range: list[float] | None = None
    alpha_sampled: float | None = None  # the sampling side of `modes` (its temperature there)
    # `alpha` and `acceptance_by_position` count every tested draft, prompt lookup's included;
    # these, the drafter's own drafts only (None in reports written before them)
    drafter_alpha: float | None = None
    drafter_acceptance_by_position: list[float] | None = None
    # how many of its own drafts were tested (0: the 0.0 above is no measurement: every tested
    # draft was prompt lookup's), overall and by position (None in reports written before them)
    drafter_trials: int | None = None
    drafter_trials_by_position: list[int] | None = None
    tau_sampled: float | None = None
    # Both serving modes side by side: {"greedy": {...}, "sampling": {...}}, each with
    # temperature/top_k/top_p, alpha, tau, speedup and tokens/s.
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    hf_assisted: dict[str, Any] | None = None
    cache: str = "dynamic"
    compiled: bool = False
    # decoder.prefill_dtype: model (prompt prefills in `dtype`) | bf16 (under bf16 autocast)
    prefill_dtype: str = "model"
    # the few-row linear path each model's decode steps took (decoder.cpu_matmul; None in
    # reports written before it)
    cpu_linears: dict[str, str] | None = None
    # Untimed time before the timed repeats: c measurement, warm-up, and compiling the decode
    # steps when `compiled` (steady-state tokens/s above exclude it).
    warmup_seconds: float = 0.0
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    # Per-round draft length (decode.draft_length): the policy, its figures (mean drafts per
    # round, share of plain target steps, histogram, step costs) and, for an adaptive policy,
    # fixed gamma measured beside it on the same prompts.
    draft_length: str = "fixed"
    draft_figures: dict[str, Any] | None = None
    fixed_gamma_speedup: float | None = None
    # engines=[ours,vllm]: the same pair, prompts and modes in vLLM (decode/validate/two_engines)
    engines: list[str] = field(default_factory=lambda: ["ours"])
    vllm: dict[str, Any] | None = None
    # long_prompts policy, prompt budget and how many prompts were truncated or skipped
    prompt_fit: dict[str, Any] = field(default_factory=dict)
    vocab_mapping: dict[str, Any] | None = None  # mapped pairs: intersection, coverage, context
    # Long prompt sets: one row per context-length bucket (decode/validate/buckets.py): prompts,
    # prompt tokens, c and verify cost at its length, prefill seconds and KV-cache bytes of p
    # and q, and per serving mode alpha, tau, speedup (end to end and decode only), lossless.
    buckets: list[dict[str, Any]] | None = None


def mode_value(v: dict[str, Any], mode: str, key: str) -> Any:
    """A validate report's figure for one serving mode (reports before `modes` existed held
    greedy figures at top level and temperature-1 alpha/tau as `*_sampled`)."""
    modes = v.get("modes")
    if modes:
        return (modes.get(mode) or {}).get(key)
    greedy = not v.get("temperature")
    if mode == "greedy":
        return v.get(key) if greedy else None
    if key in ("alpha", "tau"):
        return v.get(key) if not greedy else v.get(f"{key}_sampled")
    return v.get(key) if not greedy else None


# what the drafter's own alpha reads as when it rests on no drafts (every tested draft was
# prompt lookup's): report.md here and the pipeline's summary
NO_OWN_DRAFTS = "n/a (0 drafts of its own)"
# what an acceptance over every draft reads as when no draft was tested at all (the floor took
# plain target steps throughout): the pipeline's summary; 0 would read as every draft rejected
NO_DRAFTS = "n/a (0 drafts: target steps only)"


def _linears(linears: dict[str, str] | None) -> str:
    """Each model's few-row linear path, or n/a for a report written before it was kept."""
    return "n/a" if not linears else f"{linears['target']} / {linears['drafter']}"


def _drafter_alpha(r: ValidateResult) -> str:
    """The drafter's own acceptance with how many drafts it rests on; positions it never
    drafted at read '-' (not 0.00), and no drafts at all reads n/a (not 0.0)."""
    if r.drafter_alpha is None:
        return "n/a"
    if r.drafter_trials == 0:
        return f"{NO_OWN_DRAFTS}: every tested draft was prompt lookup's"
    tested = r.drafter_trials_by_position
    at = " ".join(
        "-" if tested is not None and i < len(tested) and not tested[i] else f"{x:.2f}"
        for i, x in enumerate(r.drafter_acceptance_by_position or [])
    )
    n = f" ({r.drafter_trials} drafts)" if r.drafter_trials is not None else ""
    return f"{r.drafter_alpha}{n} / {at}" if at else f"{r.drafter_alpha}{n}"


def report_markdown(r: ValidateResult) -> str:
    """A short side-by-side table (p = target, q = drafter)."""
    b, s = r.baseline_tokens_per_s, r.speculative_tokens_per_s
    rows = [
        (
            "device / dtype",
            f"{r.device} / {r.dtype} ({r.cache} cache{', compiled' if r.compiled else ''}"
            f"{', prefills in bf16' if r.prefill_dtype == 'bf16' else ''})",
        ),
        ("gamma", f"{r.gamma}{' (auto)' if r.gamma_auto else ''}"),
        ("temperature / top_k / top_p", f"{r.temperature} / {r.top_k} / {r.top_p}"),
        ("alpha (measured, every draft: prompt lookup's too)", f"{r.alpha}"),
        ("the drafter's own alpha (its drafts only) / by position", _drafter_alpha(r)),
        ("alpha at temperature 1", f"{r.alpha_sampled}"),
        ("tau (tokens per target forward)", f"{r.tau} (temperature 1: {r.tau_sampled})"),
        ("c (drafter / target step time)", f"{r.c}; verify step = {r.verify_cost} target steps"),
        ("CPU linears: target / drafter", _linears(r.cpu_linears)),
        ("target-only tokens/s", f"{b['median']} (min {b['min']}, max {b['max']})"),
        ("speculative tokens/s", f"{s['median']} (min {s['min']}, max {s['max']})"),
        ("speedup (measured): median (range) of repeats", speedup_text(r.speedup, r.speedup_range)),
        ("theoretical speedup", f"{r.theoretical_speedup}x"),
        ("decoder efficiency", f"{r.decoder_efficiency}"),
        ("theoretical, measured verify cost", f"{r.theoretical_speedup_measured_verify}x"),
        ("lossless", f"{r.lossless}{' (LOSSY lenience)' if r.lossy else ''}"),
        ("untimed warm-up (compile included)", f"{r.warmup_seconds} s"),
    ]
    if r.draft_figures and r.draft_length != "fixed":
        f = r.draft_figures
        rows.append(("draft length policy", f"{r.draft_length} (at most {f['max_draft']} drafts)"))
        rows.append(
            (
                "draft lengths",
                f"mean {f['mean_draft_length']}, plain target steps {f['target_step_share']}, "
                f"rounds by drafts 0..: {f['draft_lengths']}",
            )
        )
        if r.fixed_gamma_speedup is not None:
            rows.append((f"fixed gamma={r.gamma} beside it", f"{r.fixed_gamma_speedup}x"))
    if r.vocab_mapping:  # a drafter with its own tokenizer (decode/validate/mapped.py)
        v = r.vocab_mapping
        rows.append(
            (
                f"vocabulary mapping ({v['context']} context)",
                f"{v['intersection']} of the drafter's {v['draft_vocab']} tokens shared; they cover "
                f"{v['output_coverage']:.1%} of the target's output tokens",
            )
        )
    if r.hf_assisted and r.hf_assisted.get("error"):
        rows.append(("HF assisted generation", r.hf_assisted["error"]))
    elif r.hf_assisted:
        h = r.hf_assisted
        rows.append(
            (
                "HF assisted generation",
                f"{h['speedup']}x ({h['assisted_tokens_per_s']['median']} vs "
                f"{h['generate_tokens_per_s']['median']} tokens/s; same tokens as ours: {h['same_tokens']})",
            )
        )
        rows.append(("our speedup / HF's", f"{h['ours_over_hf']}"))
    lines = [
        f"# Validate: {Path(r.drafter).name} drafting for {Path(r.target).name}",
        "",
        f"{r.prompts} prompts x {r.max_new_tokens} new tokens, batch {r.batch_size}, {r.repeats} repeats.",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    lines += bucket_markdown(r.buckets)
    if r.vllm:
        lines += two_engine_table(r.vllm)
    lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def _rate(d: dict | None) -> str:
    return "n/a" if not d else f"{d['median']} ({d['min']}-{d['max']})"


def two_engine_table(v: dict[str, Any]) -> list[str]:
    """Our decoder and vLLM side by side, one column pair per serving mode."""
    modes = list(v["modes"])
    head = " | ".join(f"ours, {m} | vLLM, {m}" for m in modes)
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, ours_key, vllm_key, fmt=str) -> None:
        cells = []
        for m in modes:
            row, mine = v["modes"][m], v["modes"][m].get("ours") or {}
            cells += [fmt(mine.get(ours_key)) if ours_key else "", fmt(row.get(vllm_key))]
        rows.append((label, cells))

    add("acceptance rate (accepted / drafts tested)", "acceptance_rate", "acceptance_rate")
    add("mean acceptance length (1 + accepted per round)", "mean_acceptance_length", "mean_acceptance_length")  # fmt: skip
    add("accepted by draft position (share of rounds)", "accepted_by_position", "accepted_by_position")  # fmt: skip
    add("rounds with drafts / accepted (of drafted)", "rounds_accepted", "counters",
        lambda x: x if not isinstance(x, dict) else f"{x['drafts']} / {x['accepted_tokens']} (of {x['draft_tokens']})")  # fmt: skip
    add("target-only tokens/s, median (min-max)", "target_only_tokens_per_s", "plain_tokens_per_s", _rate)  # fmt: skip
    add("speculative tokens/s, median (min-max)", "speculative_tokens_per_s", "speculative_tokens_per_s", _rate)  # fmt: skip
    add("speedup (measured)", "speedup", "speedup", lambda x: f"{x}x")
    add("latency per call, target-only ms", None, "plain_latency_ms", _rate)
    add("latency per call, speculative ms", None, "speculative_latency_ms", _rate)
    add("speculative greedy output = plain greedy output", None, "identical_to_plain",
        lambda x: "" if x is None else str(x))  # fmt: skip
    cells = []
    for m in modes:
        a = v["modes"][m].get("agreement")
        text = "n/a" if not a else (
            f"{a['difference']:+.3f} +- {a['noise']:.3f} (z {a['z']}): "
            + ("BEYOND noise" if a["beyond_noise"] else "within noise")
        )  # fmt: skip
        cells += ["", text]
    rows.append(("vLLM - ours, mean acceptance length", cells))
    return [
        "",
        f"## Two engines: our decoder and vLLM {v['version']} (`{v['method']}`"
        f"{', parallel drafting' if v.get('parallel_drafting') else ''}"
        f"{', TLI: use_heterogeneous_vocab' if v.get('use_heterogeneous_vocab') else ''}, "
        f"{v['num_speculative_tokens']} speculative tokens, {v['dtype']}, draft sampling: "
        f"{v.get('draft_sample_method', 'n/a')})",
        "",
        f"| figure | {head} |",
        "|---|" + "---|" * (2 * len(modes)),
        *[f"| {k} | {' | '.join(str(c) for c in cells)} |" for k, cells in rows],
        "",
        *_vllm_mapping_line(v.get("vocab_mapping")),
    ]


def _vllm_mapping_line(m: dict[str, Any] | None) -> list[str]:
    """vLLM's own TLI mapping beside ours (a drafter with its own tokenizer), one line."""
    if not m:
        return []
    return [
        f"TLI mapping: vLLM {m['intersection_vllm']} / ours {m['intersection_ours']} drafter ids "
        f"in the intersection; {m['draft_ids_mapped_differently']} drafter ids and "
        f"{m['target_ids_read_differently']} target ids mapped differently by the two engines.",
        "",
    ]


def plot_acceptance(by_pos: list[float], path: Path, notes: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("matplotlib not installed: no report.png")
        return
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(range(1, len(by_pos) + 1), by_pos)
    ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
