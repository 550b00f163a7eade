"""Several drafters of the same target side by side, in one run (`compare_drafters`).

    python -m specdistill.decode.bench pair=smollm2-toy 'compare_drafters=[copy:5]' output_dir=OUT

p = target, q = drafter. `pair.drafter` (as the pair resolves it) and each entry of
`compare_drafters` (a checkpoint folder or hub name, or a layer spec such as `copy:5` /
`first:4`: a drafter cut from the target) run through the validate stage in turn, each with its
own interleaved target-only baseline, so speedups are ratios on the same footing; each entry's
`pair.vocab` is `auto`, so a drafter with its own tokenizer decodes through the vocabulary
mapping and one with the target's decodes directly. Per drafter: alpha, tau, c, speedup (both
serving modes), losslessness, `transformers` assisted generation (universal for a mapped pair),
and the mapping's intersection and coverage; on a chat benchmark (`dataset=chat_bench`) tau and
alpha by set and category per drafter. Writes OUT/drafters.json, OUT/drafters.md and
OUT/drafters_categories.png.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.runtime import ConfigError
from specdistill.decode.validate.categories import compare_table, plot_by_category
from specdistill.decode.validate.stage import run as validate_run

_LAYERS = re.compile(r"^(first|spread|copy):\d+$")


def entry_overrides(entry: Any) -> dict[str, Any]:
    """The `pair` keys one `compare_drafters` entry sets."""
    if isinstance(entry, (list, tuple)) or (isinstance(entry, str) and _LAYERS.match(entry)):
        return {"drafter": None, "drafter_layers": entry, "vocab": "auto"}
    if not isinstance(entry, str) or not entry:
        raise ConfigError(
            f"compare_drafters entry {entry!r}: name a drafter checkpoint (folder or hub name) "
            "or a layer spec such as copy:5"
        )
    return {"drafter": entry, "drafter_layers": None, "vocab": "auto"}


def run_drafters(cfg: DictConfig) -> list[dict[str, Any]]:
    """Validate pair.drafter, then each of `compare_drafters`; one row per drafter."""
    raw = cfg.get("compare_drafters")
    entries = list(raw) if raw is not None and not isinstance(raw, str) else [raw]
    overrides = [entry_overrides(e) for e in entries]  # every entry checked before any run
    out_dir = Path(str(cfg.output_dir)).expanduser().absolute()
    rows: list[dict[str, Any]] = []
    for i, pair_keys in enumerate([{}, *overrides]):
        sub = OmegaConf.merge(cfg, {"pair": pair_keys, "output_dir": str(out_dir / f"drafter{i}")})
        r = validate_run(sub)
        hf = r.hf_assisted or {}
        rows.append(
            {
                "drafter": "pair.drafter" if i == 0 else str(entries[i - 1]),
                "path": r.drafter,
                "modes": r.modes,
                "c": r.c,
                "gamma": r.gamma,
                "lossless": r.lossless,
                "hf_speedup": hf.get("speedup"),
                "hf_error": hf.get("error"),
                "vocab_mapping": r.vocab_mapping,
                "categories": r.categories,  # chat benchmarks: by set and category
            }
        )
        atomic_write_json(out_dir / "drafters.json", rows)  # a run cut short keeps its rows
    atomic_write_text(out_dir / "drafters.md", drafters_markdown(rows))
    plot_by_category(_named(rows), out_dir / "drafters_categories.png")
    return rows


def _named(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    return [(r["drafter"], r.get("categories") or []) for r in rows]


def drafters_markdown(rows: list[dict[str, Any]]) -> str:
    """One line per drafter and serving mode."""
    lines = [
        "| drafter | mode | alpha | tau | c | speedup | lossless | HF assisted | mapping |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["vocab_mapping"]
        mapping = (
            f"{v['context']}: {v['intersection']}/{v['draft_vocab']} shared, "
            f"output coverage {v['output_coverage']:.1%}"
            if v
            else "shared ids"
        )
        hf = r["hf_speedup"] if r["hf_speedup"] is not None else (r["hf_error"] or "n/a")
        for mode, f in r["modes"].items():
            lines.append(
                f"| {r['drafter']} | {mode} | {f.get('alpha')} | {f.get('tau')} | {r['c']} | "
                f"{f.get('speedup')}x | {r['lossless']} | {hf} | {mapping} |"
            )
    lines += compare_table(_named(rows), "pair.drafter")
    return "\n".join(lines) + "\n"
