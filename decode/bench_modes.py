"""Decoder step modes side by side: one bench run validates the same pair once per mode.

    python -m specdistill.decode.bench pair=toy pair.drafter=DIR/best output_dir=OUT \\
        'compare_modes=[eager,compiled]'

Modes: `eager` (dynamic cache, eager steps: the CPU default), `static` (static cache, eager
steps), `compiled` (static cache, compiled steps: inductor on CPU, CUDA graphs on CUDA). Each
mode is a full validate run under OUT/<mode>/ (its baseline and speculative passes interleaved,
both on that mode's machinery, so each speedup is fair); the modes run one after the other, so
tokens/s across modes drift with machine load more than the within-mode ratios do. HF assisted
generation is independent of the mode and is measured once (first mode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.pairs import ConfigError

MODES: dict[str, dict[str, Any]] = {
    "eager": {"cache": "dynamic", "compile": False},
    "static": {"cache": "static", "compile": False},
    "compiled": {"cache": "static", "compile": True},
}


def run_modes(cfg: DictConfig) -> list[dict[str, Any]]:
    """Validate once per mode in `compare_modes`; writes OUT/modes.json and OUT/modes.md."""
    from specdistill.decode.validate import run

    modes = list(cfg.compare_modes)
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise ConfigError(
            f"compare_modes={modes}: pick from {sorted(MODES)}, e.g. [eager,compiled]"
        )
    out = Path(str(cfg.output_dir)).expanduser().absolute()
    rows, hf = [], None
    for i, mode in enumerate(modes):
        sub = OmegaConf.merge(
            cfg,
            {
                "decoder": MODES[mode],
                "output_dir": str(out / mode),
                "compare_modes": None,
                "hf_assisted": bool(cfg.get("hf_assisted", True)) and i == 0,
            },
        )
        r = run(sub)
        hf = hf or r.hf_assisted
        rows.append(
            {
                "mode": mode,
                "cache": r.cache,
                "compiled": r.compiled,
                "baseline_tokens_per_s": r.baseline_tokens_per_s["median"],
                "speculative_tokens_per_s": r.speculative_tokens_per_s["median"],
                "c": r.c,
                "verify_cost": r.verify_cost,
                "alpha": r.alpha,
                "tau": r.tau,
                "speedup": r.speedup,
                "theoretical_speedup": r.theoretical_speedup,
                "decoder_efficiency": r.decoder_efficiency,
                "lossless": r.lossless,
                "warmup_seconds": r.warmup_seconds,
            }
        )
    atomic_write_json(out / "modes.json", {"modes": rows, "hf_assisted": hf})
    atomic_write_text(out / "modes.md", modes_markdown(rows, hf))
    return rows


def modes_markdown(rows: list[dict[str, Any]], hf: dict[str, Any] | None) -> str:
    keys = [k for k in rows[0] if k not in ("mode", "cache", "compiled")]
    lines = [
        "| figure | " + " | ".join(r["mode"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
        *[f"| {k} | " + " | ".join(str(r[k]) for r in rows) + " |" for k in keys],
    ]
    if hf:
        lines.append(
            f"| HF assisted speedup (same pair) | {hf['speedup']}x "
            f"({hf['assisted_tokens_per_s']['median']} vs {hf['generate_tokens_per_s']['median']} "
            "tokens/s) |" + " |" * (len(rows) - 1)
        )
    return "\n".join(lines) + "\n"
