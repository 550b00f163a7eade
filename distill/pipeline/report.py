"""The pipeline's report: base vs distilled drafter side by side, each figure with its method.

    python -m specdistill.distill.pipeline.report RUN_DIR   # rebuild summary.md + report.png from a run

Two different "alpha"s appear in a run and must not be confused: the validate stage's
decode-time acceptance rate (our speculative decoder on held-out prompts, in both serving
modes: greedy and sampling) and the distill stage's held-out alpha, the expected acceptance in
the serving mode (p = target, q = drafter) that picked the shipped checkpoint. The table labels
every row with which one it is and how it was measured. Reads only the stages' own result files
(those `RUN_DIR/plan/report.yaml` names), so it works on a run made here or on Slurm alike.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from specdistill.data.io import atomic_write_text, read_json
from specdistill.decode.validate.buckets import drafter_alpha_text
from specdistill.decode.validate.engines.ours import NO_OWN_DRAFTS
from specdistill.decode.validate.modes import has_range, positions
from specdistill.decode.validate.report import NO_DRAFTS, mode_value
from specdistill.distill.pipeline.category_report import category_table, plot_categories
from specdistill.distill.pipeline.chat_mode_report import chat_mode_lines
from specdistill.distill.pipeline.llamacpp_report import llamacpp_lines
from specdistill.distill.train.predict import reprice

log = logging.getLogger("specdistill.report")

# Flat figures kept in pipeline.json's summary, by the stage report that holds them.
SUMMARY_KEYS = {
    "distill": ("alpha_before", "alpha_after", "steps", "tokens_per_s", "wall_seconds"),
    "validate": (
        "alpha",
        "alpha_sampled",
        "tau",
        "tau_sampled",
        "acceptance_by_position",
        "recommended_k",
        "modes",
        "gamma",
        "c",
        "speedup",
        "theoretical_speedup",
        "decoder_efficiency",
        "lossless",
        "device",
        "dtype",
        "machine",
    ),
    "export": ("output_dir", "usage", "vocab_size", "dtype", "vllm"),
}

# (label, how it was measured, stage, key): `{T}` is the sampling side's temperature, `{K}` the
# drafts a round. Acceptance first (no clock: the same on every machine), then this machine's speed.
ROWS = [
    ("tau at K={K} (tokens per round, bonus included), greedy", "decode-time", "validate", "greedy.tau"),
    ("tau at K={K}, temperature {T}", "decode-time", "validate", "sampling.tau"),
    ("acceptance by draft position, greedy", "decode-time, each given the drafts before it were accepted", "validate", "greedy.acceptance_by_position"),
    ("acceptance by draft position, temperature {T}", "decode-time, each given the drafts before it were accepted", "validate", "sampling.acceptance_by_position"),
    ("the drafter's own alpha, greedy", "decode-time acceptance, the drafter's drafts only", "validate", "greedy.drafter_alpha"),
    ("the drafter's own alpha, temperature {T}", "decode-time acceptance, the drafter's drafts only", "validate", "sampling.drafter_alpha"),
    ("alpha, greedy", "decode-time acceptance, every draft (prompt lookup's too)", "validate", "greedy.alpha"),
    ("alpha, temperature {T}", "decode-time acceptance, every draft (prompt lookup's too)", "validate", "sampling.alpha"),
    ("lossless (output = target's)", "token-identical, greedy", "validate", "lossless"),
    ("recommended K (modeled speedup), serving mode", "cost model over acceptance by position, at this machine's c", "validate", "recommended"),
    ("rounds drafted by prompt lookup, serving mode", "share of rounds (acceptance)", "validate", "lookup"),
    ("speedup over target-only, this machine, greedy", "wall clock: median (range) of repeats", "validate", "greedy.speedup"),
    ("speedup over target-only, this machine, temperature {T}", "wall clock: median (range) of repeats", "validate", "sampling.speedup"),
    ("tokens per second, greedy: target-only / speculative", "wall clock: medians of repeats", "validate", "greedy.rates"),
    ("modeled speedup at this machine's c, serving mode", "cost model: the decode's rounds, c, verify cost", "validate", "theoretical_speedup"),
    ("HF assisted speedup, same pair", "wall clock, serving mode", "validate", "hf_speedup"),
    ("held-out alpha, {mode}", "{how}", "distill", "alpha"),
    ("held-out greedy agreement", "argmax q = argmax p on {data}", "distill", "agree"),
]  # fmt: skip


def _sampling_temperature(stages: dict[str, dict]) -> Any:
    for stage in ("validate", "validate_base"):
        side = ((stages.get(stage) or {}).get("modes") or {}).get("sampling")
        if side:
            t = f"{side['temperature']:g}"
            return t + (f", top_p {side['top_p']:g}" if side.get("top_p", 1.0) < 1 else "")
    return "1"


def _distill_labels(stages: dict[str, dict]) -> dict[str, str]:
    """How the distill stage's held-out figure was measured (its source and serving mode)."""
    data = (stages.get("distill") or {}).get("data") or {}
    smp = data.get("eval_sampling") or {"temperature": 1.0}
    greedy = not smp.get("temperature")
    source = data.get("eval_source", "reference")
    if source == "target":
        where = f"the target's {'greedy' if greedy else 'sampled'} continuations"
    else:
        where = "reference completions" if source == "reference" else "a generate run"
    mode = "greedy" if greedy else f"temperature {smp['temperature']:g}"
    if not greedy and smp.get("top_p", 1.0) < 1:
        mode += f", top_p {smp['top_p']:g}"
    how = ("[argmax q = argmax p]" if greedy else "sum min(p,q)") + f" on {where}"
    return {"mode": mode, "how": how, "data": where}


def summarize(stages: dict[str, dict]) -> dict[str, Any]:
    """Flat `stage.key` figures for pipeline.json (validate_base reads like validate)."""
    out: dict[str, Any] = {}
    for stage, figures in stages.items():
        for key in SUMMARY_KEYS.get(stage.split("_")[0], ()):  # validate_long_base: validate
            if key in figures:
                out[f"{stage}.{key}"] = figures[key]
    if "export" in stages:
        out["exported_drafter"] = stages["export"]["output_dir"]
    return out


def _value(stages: dict[str, dict], stage: str, key: str, distilled: bool) -> Any:
    if stage == "distill":
        d = stages.get("distill") or {}
        if key == "alpha" and distilled and d.get("best_alpha") is not None:
            return d["best_alpha"]  # the shipped checkpoint's (best/), not the last step's
        name = {"alpha": "alpha", "agree": "greedy_agreement"}[key]
        return d.get(f"{name}_{'after' if distilled else 'before'}")
    v = stages.get("validate" if distilled else "validate_base") or {}
    if key == "hf_speedup":
        return (v.get("hf_assisted") or {}).get("speedup")
    if key == "lookup":  # decoder.lookup (decode/lookup.py): copied from the context, no drafter
        lk = v.get("lookup")
        return f"{lk['round_share']:.2f} ({lk['acceptance']:.2f})" if lk else None
    if key == "recommended":  # validate.recommend.recommendation: this machine's costs first
        by_cost = (v.get("recommended_k") or {}).get("by_cost") or []
        if not by_cost:
            return None
        e = by_cost[0]
        return f"{e['k']} ({_shown(e['speedup'])}x at c {_shown(e['c'])})"
    if "." in key:
        mode, name = key.split(".")
        if name == "rates":  # the absolute speed beside the ratio: what the thread count buys
            return _rates(v, mode)
        got = mode_value(v, mode, name)
        if name == "acceptance_by_position":  # `-` where no round reached the position
            return positions(got, mode_value(v, mode, "trials_at")) if got else None
        if name == "drafter_alpha" and mode_value(v, mode, "drafter_trials") == 0:
            return NO_OWN_DRAFTS
        tested = mode_value(v, mode, "trials_at")  # per position; absent in older reports
        if name == "alpha" and tested is not None and not any(tested):
            return NO_DRAFTS
        return _with_range(got, mode_value(v, mode, "speedup_range") if name == "speedup" else None)
    return v.get(key)


def _rates(v: dict[str, Any], mode: str) -> str | None:
    """ "target-only / speculative" tokens per second (medians of the timed repeats), or None."""
    rates = [mode_value(v, mode, f"{side}_tokens_per_s") for side in ("baseline", "speculative")]
    if not all(isinstance(r, dict) and r.get("median") is not None for r in rates):
        return None
    return " / ".join(_rate(float(r["median"])) for r in rates)


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"  # 1224, not 1.22e+03


def _with_range(got: Any, low_high: list[float] | None) -> Any:
    """A median speedup with its per-repeat spread beside it (so a figure near 1.0 reads as
    noise or not); the value as is without a range or when the repeats agree."""
    if got is None or not has_range(low_high):
        return got
    return f"{_shown(got)} ({_shown(low_high[0])}-{_shown(low_high[1])})"


def _repeats(v: dict[str, Any]) -> str:
    """The header's ", N timed repeats" where the report says how many (the speedups' ranges
    are over them); "" for reports without the count."""
    n = v.get("repeats")
    return f", {n} timed repeat{'s' if n != 1 else ''}" if n else ""


def _shown(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def comparison_table(stages: dict[str, dict]) -> list[str]:
    """Markdown rows: figure | how measured | base drafter | distilled drafter."""
    lines = [
        "| figure | how measured | base drafter | distilled drafter |",
        "| --- | --- | --- | --- |",
    ]
    v = stages.get("validate") or stages.get("validate_base") or {}
    fill = {"T": _sampling_temperature(stages), "K": v.get("gamma"), **_distill_labels(stages)}
    for label, how, stage, key in ROWS:
        base, dist = _value(stages, stage, key, False), _value(stages, stage, key, True)
        if base is None and dist is None:
            continue
        if key == "agree" and fill["mode"] == "greedy":
            continue  # the held-out alpha row above already is this figure
        lines.append(
            f"| {label.format(**fill)} | {how.format(**fill)} | {_shown(base)} | {_shown(dist)} |"
        )
    return lines


def _bucket_cell(rows: dict[str, dict], name: str, mode: str, key: str) -> str:
    m = (rows.get(name) or {}).get("modes", {}).get(mode) or {}
    if key == "drafter_alpha":
        return drafter_alpha_text(m)
    return _shown(_with_range(m.get(key), m.get("speedup_range") if key == "speedup" else None))


# (step, label) of the validate reports a per-bucket table sets side by side
SHORT_SIDES = (("validate_base", "base"), ("validate", "distilled"))
LONG_SIDES = (  # long_context.enabled: held-out long prompts
    ("validate_long_base", "base"),
    ("validate_long_short", "short-trained"),
    ("validate_long", "long-trained"),
)
_BUCKET_FIGURES = (  # (mode, key, header): a column appears when a side reported that figure
    ("greedy", "tau", "tau, greedy"),
    ("sampling", "tau", "tau, temperature {t}"),
    ("greedy", "drafter_alpha", "the drafter's own alpha, greedy (drafts tested)"),
    ("sampling", "drafter_alpha", "the drafter's own alpha, temperature {t} (drafts tested)"),
    ("greedy", "alpha", "alpha, greedy"),
    ("sampling", "alpha", "alpha, temperature {t}"),
    ("greedy", "speedup", "speedup, greedy, this machine"),
    ("sampling", "speedup", "speedup, temperature {t}, this machine"),
)


def bucket_table(
    stages: dict[str, dict], sides: tuple[tuple[str, str], ...] = SHORT_SIDES
) -> list[str]:
    """One per-bucket table when the validate reports of `sides` have context-length buckets
    (long prompt sets, decode/validate/buckets.py): the sides' figures in each cell, in order;
    c, the verify cost and KV memory are the last side's that ran (the trained
    drafter's; the base's when it alone ran). A figure's column appears only when some side
    reported it: a mode's only where a side decoded in it (the long leg decodes the serving
    mode only), the drafter's own alpha only from reports that count it."""
    rows = {
        step: {r["bucket"]: r for r in (stages.get(step) or {}).get("buckets") or []}
        for step, _ in sides
    }
    present = [(step, label) for step, label in sides if rows[step]]
    names = list(dict.fromkeys(name for step, _ in present for name in rows[step]))
    if not names:
        return []
    t = _sampling_temperature(stages)
    # (mode, figure) pairs some side reported (a report from before a figure lacks its column)
    ran = {(m, k) for step, _ in present for r in rows[step].values()
           for m, fig in r.get("modes", {}).items() for k in fig}  # fmt: skip
    figures = [(m, k, h.format(t=t)) for m, k, h in _BUCKET_FIGURES if (m, k) in ran]
    labels = " / ".join(label for _, label in present)
    heads = ["bucket", "prompts (mean tokens)", *(h for _, _, h in figures),
             "c / verify cost", "KV MiB, target / drafter"]  # fmt: skip
    lines = [
        "",
        f"By context-length bucket (decode-time, {labels} drafter; speedups end to end on this "
        "machine, prefills included, median (range) of repeats; c and the verify cost timed at "
        "the bucket's length):",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + " --- |" * len(heads),
    ]
    for name in names:
        own = next(rows[step][name] for step, _ in reversed(present) if name in rows[step])
        kv = own["kv_cache"]
        cells = [
            f"{own['prompts']} ({own['mean_prompt_tokens']:g})",
            *(
                " / ".join(_bucket_cell(rows[step], name, mode, key) for step, _ in present)
                for mode, key, _ in figures
            ),
            f"{_shown(own['c'])} / {_shown(own['verify_cost'])}",
            f"{kv['target_bytes'] / 2**20:.1f} / {kv['drafter_bytes'] / 2**20:.1f}",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def long_context_lines(stages: dict[str, dict]) -> list[str]:
    """`long_context.enabled`: the long fine-tune (rows, steps, wall, its drafter) and the three
    drafters by bucket on held-out long prompts."""
    table = bucket_table(stages, LONG_SIDES)
    d = stages.get("distill_long")
    if not table and not d:
        return []
    lines = ["", "## Long contexts (`long_context`)"]
    if d:
        g = stages.get("generate_long") or {}
        rows = f"{_shown(g.get('samples'))} Seq-KD rows after long prompts"
        if g.get("wall_seconds") is not None:
            rows += f" (generated in {_shown(g['wall_seconds'])} s)"
        lines += [
            "",
            f"The run's drafter fine-tuned on {rows}: {d.get('steps')} steps, "
            f"{_shown(d.get('wall_seconds'))} s; the long-trained drafter is `{d.get('final_path')}` "
            f"(held-out alpha on the short rows {_shown(d.get('alpha_before'))} -> "
            f"{_shown(d.get('alpha_after'))}).",
        ]
    return lines + table


def decoder_words(v: dict[str, Any]) -> str:
    """How a validate report drafted: `K=G drafts a round`, or the policy and its most drafts."""
    policy = v.get("draft_length", "fixed")
    if policy == "fixed":
        return f"K={v.get('gamma')} drafts a round (fixed, as the engines serve)"
    return f"draft length `{policy}` (at most {v.get('max_draft')} drafts a round)"


def summary_markdown(
    run_dir: str,
    stages: dict[str, dict],
    wall_seconds: float | None,
    serving: dict[str, Any] | None = None,
    recipe: dict[str, Any] | None = None,
) -> str:
    v = stages.get("validate") or stages.get("validate_base") or {}
    lines = [f"# specdistill run: {run_dir}", ""]
    if v:
        lines += [
            f"Decode-time figures: `specdistill.decode.validate.stage`, {v.get('prompts')} held-out "
            f"prompts x {v.get('max_new_tokens')} new tokens{_repeats(v)}, {decoder_words(v)}, "
            f"{v.get('device')} / {v.get('dtype')}, both serving modes (greedy and sampling). "
            "Acceptance figures are the same on any machine for these weights (training them is "
            "not bit-identical across CPU kinds); speed figures are this machine's"
            f" ({v.get('machine') or 'n/a'}). Held-out alpha: the distill stage's expected "
            "acceptance (not decoded) that picked the shipped checkpoint.",
            "",
        ]
    lines += comparison_table(stages)
    lines += category_table(stages)
    lines += chat_mode_lines(stages)
    lines += llamacpp_lines(stages)
    lines += bucket_table(stages)
    d = stages.get("distill")
    if d:
        loss = (d.get("loss") or {}).get("name", "?")
        lines += [
            "",
            f"Distilled with loss {loss}, lmbda {d.get('lmbda')}, {d.get('steps')} steps "
            f"(best held-out alpha at step {d.get('best_step')}): `{d.get('drafter_path')}`.",
        ]
        pred = d.get("heldout_prediction")
        lines += prediction_lines(reprice(pred, v) if pred and v else pred)
    if serving:
        how = serving.get("mode", "?")
        if how == "sampling":
            smp = serving.get("sampling") or serving  # runs before the one spec: flat keys
            how += f" at temperature {smp.get('temperature')}, top_p {smp.get('top_p')}"
        lines += ["", f"Served {how}; recipe `{(recipe or {}).get('name')}`: {recipe}."]
    e = stages.get("export")
    if e:
        lines += [
            "",
            f"Exported drafter (self-checked): `{e['output_dir']}`",
            "",
            f"Use it: `{e['usage']}`",
        ]
        lines += vllm_lines(e.get("vllm"))
    lines += long_context_lines(stages)
    if wall_seconds is not None:
        lines += ["", f"wall time: {wall_seconds} s"]
    return "\n".join(lines) + "\n"


def vllm_lines(v: dict[str, Any] | None) -> list[str]:
    """The exported drafter in vLLM (`vllm=true`): its acceptance and speedup beside ours."""
    if not v:
        return []
    lines = [
        "",
        f"In vLLM {v.get('version')} (the exported drafter as `draft_model`, "
        f"{v.get('num_speculative_tokens')} speculative tokens, {v.get('device')}; report: "
        f"`{v.get('report')}`):",
        "",
        "| mode | acceptance rate, vLLM / ours | mean acceptance length, vLLM / ours | speedup, vLLM / ours |",
        "| --- | --- | --- | --- |",
    ]  # fmt: skip
    for mode, m in (v.get("modes") or {}).items():
        flag = " (beyond noise)" if m.get("beyond_noise") else ""
        lines.append(
            f"| {mode} | {_shown(m.get('acceptance_rate'))} / "
            f"{_shown(m.get('ours_acceptance_rate'))}{flag} | "
            f"{_shown(m.get('mean_acceptance_length'))} / "
            f"{_shown(m.get('ours_mean_acceptance_length'))} | "
            f"{_shown(m.get('speedup'))}x / {_shown(m.get('ours_speedup'))}x |"
        )
    same = v.get("greedy_identical_to_plain")
    lines += ["", f"vLLM greedy output with the drafter = its plain greedy output: {_shown(same)}"]
    return lines + [f"- {n}" for n in v.get("notes") or []]


def prediction_lines(pred: dict[str, Any] | None) -> list[str]:
    """The distill stage's held-out replay of the decoder (greedy serving), when it ran."""
    if not pred:
        return []
    how = "exact replay" if pred.get("exact") else "estimate (reference completions)"
    c = pred.get("costs") or {}
    figs = ", ".join(
        f"{name} {f['speedup']}x (tau {f['tau']})" for name, f in pred.get("figures", {}).items()
    )
    return [
        "",
        f"Predicted from the held-out set ({how}, {pred.get('rows')} rows, costs "
        f"{c.get('source')}: c {c.get('c')}): {figs}.",
    ]


def plot_acceptance(stages: dict[str, dict], path: Path) -> bool:
    """report.png: acceptance by draft position, base and distilled drafter side by side, one
    panel per serving mode the reports hold (greedy, then sampling)."""
    sides = (("base drafter", "validate_base"), ("distilled drafter", "validate"))
    panels = []
    for mode in ("greedy", "sampling"):
        series = [(name, mode_value(stages.get(step) or {}, mode, "acceptance_by_position"))
                  for name, step in sides]  # fmt: skip
        series = [(n, v) for n, v in series if v]
        if series:
            panels.append((mode, series))
    if not panels:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", path)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.2), squeeze=False)
    t = _sampling_temperature(stages)
    for ax, (mode, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            xs = [k + 1 + (i - (len(series) - 1) / 2) * width for k in range(len(values))]
            ax.bar(xs, values, width=width, label=name)
        title = "greedy" if mode == "greedy" else f"temperature {t}"
        ax.set(xlabel="draft position", ylabel="P(accept | reached)", ylim=(0, 1.2), title=title)
        ax.set_xticks(range(1, max(len(v) for _, v in series) + 1))
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def load_stages(run_dir: Path) -> dict[str, dict]:
    """A run folder's stage results: those its plan names (`plan/report.yaml`, written by the
    pipeline, local or Slurm), else the default layout's."""
    plan = run_dir / "plan" / "report.yaml"
    if plan.is_file():
        from omegaconf import OmegaConf

        results = OmegaConf.to_container(OmegaConf.load(plan).config.results)
        return {k: read_json(f) for k, f in results.items() if Path(f).is_file()}  # type: ignore[union-attr]
    files = {
        "generate": "generate/result.json",
        "distill": "distill/result.json",
        "validate_base": "validate_base/report.json",
        "validate": "validate/report.json",
        "export": "export/drafter/export.json",
    }
    return {k: read_json(run_dir / f) for k, f in files.items() if (run_dir / f).is_file()}


def write_report(
    run_dir: Path,
    stages: dict[str, dict],
    wall_seconds: float | None,
    serving: dict[str, Any] | None = None,
    recipe: dict[str, Any] | None = None,
) -> str:
    text = summary_markdown(str(run_dir), stages, wall_seconds, serving, recipe)
    atomic_write_text(run_dir / "summary.md", text)
    plot_acceptance(stages, run_dir / "report.png")
    plot_categories(stages, run_dir / "report_categories.png")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    stages = load_stages(args.run_dir)
    if not stages:
        parser.error(f"run_dir={args.run_dir}: no stage results there")
    pj = args.run_dir / "pipeline.json"
    summary = read_json(pj).get("summary", {}) if pj.is_file() else {}
    print(write_report(args.run_dir, stages, None, summary.get("serving"), summary.get("recipe")))


if __name__ == "__main__":
    main()
