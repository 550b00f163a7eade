"""The validate stage's human-readable outputs: report.md (a side-by-side table) and report.png
(acceptance by draft position). p = target, q = drafter."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdistill.decode.validate.stage import ValidateResult


def report_markdown(r: ValidateResult) -> str:
    """A short side-by-side table (p = target, q = drafter)."""
    b, s = r.baseline_tokens_per_s, r.speculative_tokens_per_s
    rows = [
        (
            "device / dtype",
            f"{r.device} / {r.dtype} ({r.cache} cache{', compiled' if r.compiled else ''})",
        ),
        ("gamma", f"{r.gamma}{' (auto)' if r.gamma_auto else ''}"),
        ("temperature / top_k / top_p", f"{r.temperature} / {r.top_k} / {r.top_p}"),
        ("alpha (measured)", f"{r.alpha}"),
        ("alpha at temperature 1", f"{r.alpha_sampled}"),
        ("tau (tokens per target forward)", f"{r.tau} (temperature 1: {r.tau_sampled})"),
        ("c (drafter / target step time)", f"{r.c}; verify step = {r.verify_cost} target steps"),
        ("target-only tokens/s", f"{b['median']} (min {b['min']}, max {b['max']})"),
        ("speculative tokens/s", f"{s['median']} (min {s['min']}, max {s['max']})"),
        ("speedup (measured)", f"{r.speedup}x"),
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
    if r.hf_assisted:
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
    lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


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
