"""The validate stage: what a drafter is worth at the engines' K, and that the output stayed p's.

    python -m specdistill.decode.validate pair=toy-tiny output_dir=DIR
    python -m specdistill.decode.validate pair=toy pair.drafter=/path/to/distilled decoder=sampling

On the same prompts it decodes with the target p alone and speculatively (drafter q proposes, p
verifies) at the decoder's K, in both serving modes. The figures of record need no clock and
are the same on every machine: tau, acceptance by draft position, alpha (the drafter's own apart
from prompt lookup's) and `lossless` (greedy: token-identical to target-only). Then speed,
stated for what it is: this machine's measured speedup, the cost model's speedup at this
machine's c and at a user's `cost_model`, the K that maximises it (export writes it as the
engines' setting), and the same pair in the other engines it was given (decode/validate/engines/:
`transformers` assisted generation, vLLM, llama.cpp), each beside ours.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.runtime import run_or_exit
from specdistill.data.stage_config import check_command_line
from specdistill.decode.speculative import SpeculativeDecoder
from specdistill.decode.validate.buckets import measure_buckets, regroup
from specdistill.decode.validate.categories import category_rows, plot_by_category
from specdistill.decode.validate.engines import ENGINES, chosen, run_order
from specdistill.decode.validate.engines.base import Job
from specdistill.decode.validate.engines.ours import ServingMeasurement
from specdistill.decode.validate.loaded import Setup
from specdistill.decode.validate.mapped import mapping_figures
from specdistill.decode.validate.recommend import recommendation
from specdistill.decode.validate.report import ValidateResult, plot_acceptance, report_markdown
from specdistill.decode.validate.settings import ValidateSettings, removed_keys
from specdistill.decode.validate.setup import setup
from specdistill.decode.validate.timing import machine_name

log = logging.getLogger(__name__)


def settings(
    vs: ValidateSettings, st: Setup, dec: SpeculativeDecoder, gamma: int
) -> dict[str, Any]:
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


def run_engines(
    vs: ValidateSettings, st: Setup, passes: dict[str, list] | None, notes: list[str]
) -> tuple[ServingMeasurement, dict[str, Any]]:
    """Every engine it was given on the same prompts, ours first (the others stand beside it):
    ours' measurement, and the others' report.json sections by name (None: not run)."""
    job = Job(st, vs.decoder, vs.other, vs.max_new_tokens, vs.repeats, vs.seed,
              vs.step_time_iters, vs.progress, vs.output_dir, passes)  # fmt: skip
    sections: dict[str, Any] = {name: None for name in ENGINES if name != "ours"}
    ours, *others = run_order(chosen(vs.engines, vs.hf_assisted))
    done = ours.run(job, st.ready.get(ours.name))
    sv: ServingMeasurement = done.section
    notes.extend(done.notes)
    job = dataclasses.replace(job, ours=sv.beside())
    for engine in others:
        done = engine.run(job, st.ready.get(engine.name))
        notes.extend(done.notes)
        sections[engine.name] = done.section
    return sv, sections


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
    sv, side = run_engines(vs, st, passes, notes)
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
    recommended = recommendation(vs, st, sv, info["machine"])
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
