"""The validate stage's outputs: what report.json holds (ValidateResult) and how a reader takes
one serving mode's figure from it (mode_value), report.md (a side-by-side table) and report.png
(acceptance by draft position). p = target, q = drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.decode.validate.buckets import bucket_markdown
from specdistill.decode.validate.categories import category_markdown
from specdistill.decode.validate.llamacpp_engine import llamacpp_table
from specdistill.decode.validate.modes import positions, rate_text, speedup_text


@dataclass
class ValidateResult:
    """Everything report.json holds; p = target, q = drafter, K = gamma = drafts a round."""

    output_dir: str
    target: str
    drafter: str
    device: str
    dtype: str
    gamma: int
    temperature: float
    top_k: int
    top_p: float
    lenience: float
    lossy: bool
    batch_size: int
    prompts: int
    max_new_tokens: int
    repeats: int
    # the figures of record (no clock: the same on every machine)
    tau: float
    acceptance_by_position: list[float]
    alpha: float
    acceptance_rate: float
    lossless: bool | None
    mismatched_sequences: int
    # this machine's speed: c, the verify cost, the measured and the cost model's speedup
    c: float
    verify_cost: float
    baseline_tokens_per_s: dict[str, float]
    speculative_tokens_per_s: dict[str, float]
    speedup: float
    theoretical_speedup: float
    decoder_efficiency: float
    machine: str = ""
    speedup_range: list[float] | None = None  # [lowest, highest] per-repeat speedup
    alpha_sampled: float | None = None  # the sampling side of `modes` (its temperature there)
    tau_sampled: float | None = None
    # the drafter's own drafts only (`alpha` counts prompt lookup's too), and how many
    drafter_alpha: float | None = None
    drafter_acceptance_by_position: list[float] | None = None
    drafter_trials: int | None = None
    drafter_trials_by_position: list[int] | None = None
    lookup: dict[str, float] | None = None
    # both serving modes side by side: {"greedy": {...}, "sampling": {...}}
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the K that maximises the cost model's speedup (validate.stage.recommendation)
    recommended_k: dict[str, Any] | None = None
    hf_assisted: dict[str, Any] | None = None
    cache: str = "dynamic"
    compiled: bool = False
    # untimed warm-up and compiling, excluded from the tokens/s above
    warmup_seconds: float = 0.0
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    # decoder.draft_length (fixed, heuristic, confidence): rounds by drafts verified and their mean
    draft_length: str = "fixed"
    max_draft: int = 0
    mean_draft_length: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)
    # engines=[ours,vllm]: the same pair, prompts and modes in vLLM (decode/validate/two_engines)
    engines: list[str] = field(default_factory=lambda: ["ours"])
    vllm: dict[str, Any] | None = None
    # engines=[ours,llamacpp]: the same prompts and modes in llama-server (llamacpp_engine.py)
    llamacpp: dict[str, Any] | None = None
    # long_prompts policy, prompt budget and how many prompts were truncated or skipped
    prompt_fit: dict[str, Any] = field(default_factory=dict)
    vocab_mapping: dict[str, Any] | None = None  # mapped pairs: intersection, coverage, context
    # Long prompt sets: one row per context-length bucket (decode/validate/buckets.py)
    buckets: list[dict[str, Any]] | None = None
    # Chat benchmarks: one row per (set, category), set and `all`, per serving mode (categories.py)
    categories: list[dict[str, Any]] | None = None


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
# what an acceptance over every draft reads as when no draft was tested at all (every round a
# plain target step): the pipeline's summary; 0 would read as every draft rejected
NO_DRAFTS = "n/a (0 drafts: target steps only)"


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


def recommended_rows(rec: dict[str, Any] | None) -> list[tuple[str, str]]:
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


def report_markdown(r: ValidateResult) -> str:
    """Acceptance first (the same on every machine), then this machine's speed."""
    b, s = r.baseline_tokens_per_s, r.speculative_tokens_per_s
    rows = []
    for name, m in r.modes.items():
        t = "" if name == "greedy" else f", temperature {m.get('temperature')}"
        rows.append((f"tau at K={r.gamma}, {name}{t}", f"**{m['tau']}**"))
        at = positions(m.get("acceptance_by_position"), m.get("trials_at"))
        rows.append((f"acceptance by draft position, {name}", at))
    rows += [
        ("the drafter's own alpha (its drafts only) / by position", _drafter_alpha(r)),
        ("lossless", f"{r.lossless}{' (LOSSY lenience)' if r.lossy else ''}"),
        ("temperature / top_k / top_p (serving mode)", f"{r.temperature} / {r.top_k} / {r.top_p}"),
        *recommended_rows(r.recommended_k),
        ("machine (speed figures below are this machine's)", r.machine or "n/a"),
        ("device / dtype", f"{r.device} / {r.dtype} ({r.cache} cache{', compiled' if r.compiled else ''})"),
        ("c (drafter / target step time)", f"{r.c}; verify step = {r.verify_cost} target steps"),
        ("target-only tokens/s", f"{b['median']} (min {b['min']}, max {b['max']})"),
        ("speculative tokens/s", f"{s['median']} (min {s['min']}, max {s['max']})"),
        ("speedup (measured): median (range) of repeats", speedup_text(r.speedup, r.speedup_range)),
        ("modeled speedup at this machine's c", f"{r.theoretical_speedup}x (efficiency {r.decoder_efficiency})"),
        ("untimed warm-up (compile included)", f"{r.warmup_seconds} s"),
    ]  # fmt: skip
    if r.draft_length != "fixed":
        rows.append(
            (
                f"draft lengths ({r.draft_length}, at most {r.max_draft})",
                f"mean {r.mean_draft_length}, rounds by drafts 0..: {r.draft_lengths}",
            )
        )
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
        f"{r.prompts} prompts x {r.max_new_tokens} new tokens, K={r.gamma} "
        f"({r.draft_length}), batch {r.batch_size}, {r.repeats} timed repeats.",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    lines += bucket_markdown(r.buckets)
    lines += category_markdown(r.categories)
    if r.vllm:
        lines += two_engine_table(r.vllm)
    if r.llamacpp:
        lines += llamacpp_table(r.llamacpp)
    lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


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
    add("target-only tokens/s, median (min-max)", "target_only_tokens_per_s", "plain_tokens_per_s", rate_text)  # fmt: skip
    add("speculative tokens/s, median (min-max)", "speculative_tokens_per_s", "speculative_tokens_per_s", rate_text)  # fmt: skip
    add("speedup (measured)", "speedup", "speedup", lambda x: f"{x}x")
    add("latency per call, target-only ms", None, "plain_latency_ms", rate_text)
    add("latency per call, speculative ms", None, "speculative_latency_ms", rate_text)
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


def plot_acceptance(modes: dict[str, dict[str, Any]], path: Path, notes: list[str]) -> None:
    """report.png: acceptance by draft position, one bar group per serving mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("matplotlib not installed: no report.png")
        return
    fig, ax = plt.subplots(figsize=(4.5, 3))
    width = 0.8 / max(len(modes), 1)
    for i, (name, m) in enumerate(modes.items()):
        at = m.get("acceptance_by_position") or []
        ax.bar([j + 1 + (i - (len(modes) - 1) / 2) * width for j in range(len(at))], at, width,
               label=f"{name} (tau {m.get('tau')})")  # fmt: skip
    ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
