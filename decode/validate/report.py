"""The validate stage's outputs: what report.json holds (ValidateResult) and how a reader takes
one serving mode's figure from it (mode_value), report.md (a side-by-side table) and report.png
(acceptance by draft position). p = target, q = drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.decode.validate.buckets import bucket_markdown
from specdistill.decode.validate.categories import category_markdown
from specdistill.decode.validate.engines import ENGINES


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
    # the K that maximises the cost model's speedup (decode/validate/recommend.py)
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
    # engines=[ours,vllm]: the same pair, prompts and modes in vLLM (decode/validate/engines/vllm.py)
    engines: list[str] = field(default_factory=lambda: ["ours"])
    vllm: dict[str, Any] | None = None
    # engines=[ours,llamacpp]: the same prompts and modes in llama-server (engines/llamacpp.py)
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


# what an acceptance over every draft reads as when no draft was tested at all (every round a
# plain target step): the pipeline's summary; 0 would read as every draft rejected
NO_DRAFTS = "n/a (0 drafts: target steps only)"


def report_markdown(r: ValidateResult) -> str:
    """Acceptance first (the same on every machine), then this machine's speed: ours and each
    engine's rows in one figure table, then each engine's own section, then the notes."""
    record = vars(r)
    parts = [e.report(record) for e in ENGINES.values()]
    lines = [
        f"# Validate: {Path(r.drafter).name} drafting for {Path(r.target).name}",
        "",
        f"{r.prompts} prompts x {r.max_new_tokens} new tokens, K={r.gamma} "
        f"({r.draft_length}), batch {r.batch_size}, {r.repeats} timed repeats.",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for part in parts for k, v in part.rows],
        "",
    ]
    lines += bucket_markdown(r.buckets)
    lines += category_markdown(r.categories)
    lines += [line for part in parts for line in part.lines]
    lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


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
