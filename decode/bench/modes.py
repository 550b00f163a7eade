"""Decoder step modes side by side, interleaved in one process on one loaded pair.

    python -m specdistill.decode.bench pair=toy pair.drafter=DIR/best output_dir=OUT \\
        'compare_modes=[eager,compiled]'

Modes: `eager` (dynamic cache, eager steps: the CPU default), `static` (static cache, eager
steps), `compiled` (static cache, compiled steps: inductor on CPU, CUDA graphs on CUDA),
`compiled-drafter` (only the drafter's steps compiled, over their own static cache; the target,
and so the target-only baseline, keeps the default cache and eager steps). Every
mode decodes the same prompts; each timed repeat runs baseline then speculative for every mode in
turn, so load drifts on a shared machine hit all modes alike (medians reported). Within a mode
the baseline uses that mode's machinery, so each speedup is like for like. Untimed warm-up
(compile included) is reported per mode. HF assisted generation is mode-independent: measured once.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from omegaconf import DictConfig

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.runtime import ConfigError
from specdistill.decode.acceptance import theoretical_speedup
from specdistill.decode.outputs import emitted_tokens
from specdistill.decode.speculative import SpeculativeDecoder
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.decode.validate.stage import _merge, _run_all, setup, warm_up
from specdistill.decode.validate.timing import hf_assisted_speed, step_costs

MODES: dict[str, dict[str, Any]] = {
    "eager": {"cache": "dynamic", "compile": False},
    "static": {"cache": "static", "compile": False},
    "compiled": {"cache": "static", "compile": True},
    "compiled-drafter": {"cache": "auto", "compile": "drafter"},
}


def run_modes(cfg: DictConfig) -> list[dict[str, Any]]:
    """Measure every mode in `compare_modes`; writes OUT/modes.json and OUT/modes.md."""
    modes = list(cfg.compare_modes or [])
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise ConfigError(
            f"compare_modes={modes}: pick from {sorted(MODES)}, e.g. [eager,compiled]"
        )
    vs = ValidateSettings.from_cfg(cfg)
    gamma = vs.decoder.gamma
    if gamma is None:
        raise ConfigError("decoder.gamma=auto: compare_modes needs a fixed gamma (e.g. 4)")
    out = vs.output_dir
    st = setup(cfg, gamma, vs)
    seed, reps, iters = vs.seed, vs.repeats, vs.step_time_iters
    decs: dict[str, SpeculativeDecoder] = {}
    rows: dict[str, dict[str, Any]] = {}
    for mode in modes:
        settings = vs.decoder.replace(**MODES[mode])
        dec = SpeculativeDecoder(
            st.target,
            st.drafter,
            settings.decoder_config(vs.max_new_tokens, st.eos, gamma),
            tokenizer_len=len(st.tok),
        )
        t0 = time.perf_counter()
        c, verify = step_costs(dec, st.warm[0][0], iters, gamma)  # compiles the step shapes
        warm_up(dec, st.batches, st.warm, seed)
        decs[mode] = dec
        rows[mode] = {"mode": mode, "cache": "static" if dec.static else "dynamic"}
        rows[mode] |= {
            "compiled": MODES[mode]["compile"],
            "c": round(c, 4),
            "verify_cost": round(verify, 3),
        }
        rows[mode] |= {"warmup_seconds": round(time.perf_counter() - t0, 1)}
    rates: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
    first: dict[str, tuple[Any, Any]] = {}
    for rep in range(reps):
        for mode in modes:
            tb, bo = _run_all(decs[mode].baseline, st.batches, seed + rep)
            ts, so = _run_all(decs[mode].generate, st.batches, seed + rep)
            rates[mode][0].append(emitted_tokens(bo) / tb)
            rates[mode][1].append(emitted_tokens(so) / ts)
            first.setdefault(mode, (_merge(bo), _merge(so)))
    reference = first[modes[0]][0].tokens
    for mode in modes:
        base, spec = first[mode]
        b, s = statistics.median(rates[mode][0]), statistics.median(rates[mode][1])
        alpha, c = spec.alpha, rows[mode]["c"]
        alpha_in = min(max(alpha, 0.0), 1.0)
        theory = theoretical_speedup(alpha_in, gamma, c)
        rows[mode] |= {
            "baseline_tokens_per_s": round(b, 2),
            "speculative_tokens_per_s": round(s, 2),
            "alpha": round(alpha, 4),
            "tau": round(spec.tau, 3),
            "speedup": round(s / b, 3),
            "theoretical_speedup": round(theory, 3),
            "decoder_efficiency": round(s / b / theory, 3),
            # the same formula with the verify's measured cost instead of 1 target step: the
            # gap left between it and the measured speedup is the round's glue and non-iid alpha
            "theoretical_speedup_measured_verify": round(
                theoretical_speedup(alpha_in, gamma, c, rows[mode]["verify_cost"]), 3
            ),
            "lossless": spec.tokens == base.tokens == reference
            if decs[mode].cfg.sampling.greedy
            else None,
        }
    hf = None
    if vs.hf_assisted:
        dec = decs[modes[0]]
        hf = hf_assisted_speed(
            st.target, st.drafter, st.tok, st.warm, st.batches, dec.cfg, reps, first[modes[0]][0]
        )
    table = [rows[m] for m in modes]
    atomic_write_json(out / "modes.json", {"modes": table, "hf_assisted": hf, "gamma": gamma})
    atomic_write_text(out / "modes.md", modes_markdown(table, hf))
    return table


def modes_markdown(rows: list[dict[str, Any]], hf: dict[str, Any] | None) -> str:
    """Modes as columns, figures as rows (p = target, q = drafter)."""
    keys = [k for k in rows[0] if k != "mode"]
    lines = [
        "| figure | " + " | ".join(r["mode"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
        *[f"| {k} | " + " | ".join(str(r[k]) for r in rows) + " |" for k in keys],
    ]
    if hf:
        lines.append(
            f"| HF assisted speedup (same pair, mode-independent) | {hf['speedup']}x "
            f"({hf['assisted_tokens_per_s']['median']} vs {hf['generate_tokens_per_s']['median']} "
            "tokens/s) |" + " |" * (len(rows) - 1)
        )
    return "\n".join(lines) + "\n"
