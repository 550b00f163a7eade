"""Does the distill stage's held-out figure predict the validate stage's decode-time alpha?

    python -m specdistill.distill.bench.eval SWEEP_VAL_DIR --runs RUNS_DIR [--pair toy]

For every recipe folder in SWEEP_VAL_DIR (validate reports, as `recipe_summary` reads them)
whose drafter is RUNS_DIR/<recipe>/final (or the base drafter for `base`), it computes the
held-out figures both ways the distill stage can (`distill/train/evaluate.py`): on the target's own
continuations of the toy test prompts in each serving mode (what picks best/ now) and at
temperature 1 on reference completions (what picked it before), and sets them beside the
validate alpha of the toy test prompts. Writes SWEEP_VAL_DIR/predict.md and predict.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_role, load_tokenizer, resolve_pair
from specdistill.distill.bench.recipe_summary import collect
from specdistill.distill.train import sources
from specdistill.distill.train.data import collate
from specdistill.distill.train.evaluate import evaluate
from specdistill.distill.train.settings import TrainSettings

# (column, eval overrides): the mode's serving temperature, 0 = greedy.
EVALS = {
    "target_greedy": ["eval.source=target", "eval.sampling.temperature=0.0"],
    "target_t1": ["eval.source=target", "eval.sampling.temperature=1.0"],
    "reference_t1": ["eval.source=reference", "eval.sampling.temperature=1.0"],
}


def _pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def run(val_dir: Path, runs_dir: Path, pair: str, limit: int, work: Path) -> dict[str, Any]:
    from accelerate import Accelerator
    from hydra import compose, initialize_config_module

    torch.set_num_threads(1)
    rows = [r for r in collect(val_dir) if "toy-test" in r["sets"]]
    acc = Accelerator(cpu=True)
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfgs = {
            name: compose(
                config_name="distill",
                overrides=[
                    f"pair={pair}",
                    "logger=none",
                    f"output_dir={work}",
                    f"eval.limit={limit}",
                    f"eval.path={work / name}",
                    *ov,
                ],
            )
            for name, ov in EVALS.items()
        }
        spec = resolve_pair(next(iter(cfgs.values())).pair, stage="distill bench")
        tok = load_tokenizer(spec)
        batches = {}
        for name, cfg in cfgs.items():
            ex = sources.build_eval_examples(
                TrainSettings.from_cfg(cfg), cfg, tok, acc, target=spec.target
            )
            batches[name] = [
                collate(ex[i : i + 16], tok.pad_token_id, 256) for i in range(0, len(ex), 16)
            ]
    target = load_role(spec, "target", device="cpu")
    out = []
    for r in rows:
        drafter = spec.drafter if r["recipe"] == "base" else str(runs_dir / r["recipe"] / "final")
        if not Path(drafter).exists():
            continue
        q = load_role(dataclasses.replace(spec, drafter=drafter), "drafter", device="cpu")
        rec: dict[str, Any] = {"recipe": r["recipe"]}
        for name, cfg in cfgs.items():
            s = TrainSettings.from_cfg(cfg).eval.sampling
            rec[name] = evaluate(q, target, batches[name], vocab=len(tok), sampling=s)["alpha"]
        toy = r["sets"]["toy-test"]
        rec["validate_greedy"] = (toy.get("greedy") or {}).get("alpha")
        rec["validate_t1"] = (toy.get("sampling") or {}).get("alpha")
        out.append(rec)
    fits = {}
    for mode, cols in (
        ("greedy", ("target_greedy", "reference_t1")),
        ("t1", ("target_t1", "reference_t1")),
    ):
        pts = [r for r in out if r[f"validate_{mode}"] is not None]
        for col in cols:
            xs, ys = [r[col] for r in pts], [r[f"validate_{mode}"] for r in pts]
            fits[f"{col}->validate_{mode}"] = {
                "pearson": round(_pearson(xs, ys), 3),
                "mean_abs_error": round(
                    sum(abs(x - y) for x, y in zip(xs, ys)) / max(len(xs), 1), 3
                ),
            }
    return {"rows": out, "fits": fits, "limit": limit, "pair": pair}


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Held-out figure vs validate alpha (toy test prompts; {res['limit']} held-out prompts)",
        "",
        "| recipe | validate greedy | held-out greedy (target cont.) | validate T=1 | "
        "held-out T=1 (target cont.) | old: held-out T=1 (reference) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    for r in res["rows"]:
        lines.append(
            f"| {r['recipe']} | {f(r['validate_greedy'])} | {f(r['target_greedy'])} | "
            f"{f(r['validate_t1'])} | {f(r['target_t1'])} | {f(r['reference_t1'])} |"
        )
    lines += [
        "",
        "| predictor -> validate | Pearson r over recipes | mean abs error |",
        "| --- | --- | --- |",
    ]
    for k, v in res["fits"].items():
        lines.append(f"| {k} | {v['pearson']} | {v['mean_abs_error']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("val_dir", type=Path)
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--pair", default="toy")
    ap.add_argument("--limit", type=int, default=64)
    args = ap.parse_args()
    res = run(args.val_dir, args.runs, args.pair, args.limit, args.val_dir.parent / "bench_eval")
    atomic_write_json(args.val_dir / "predict.json", res)
    text = markdown(res)
    atomic_write_text(args.val_dir / "predict.md", text)
    print(text)


if __name__ == "__main__":
    main()
