"""The plan refuses evaluation rows that are training rows, from the configs alone.

At run time validate refuses prompts among the run's Seq-KD rows (`training_data`,
data/heldout_check.py's `check_disjoint`), but only after generate and distill have run; and
distill's held-out eval, which picks `best/`, is never checked at all. So before any step starts
the plan applies the same rule to the configs the steps will get (`shared_rows`: the same source
and split, no held-out split between them): every validate step that carries `training_data`
against the generate step that writes it, and distill's eval rows against the rows it trains on.
"""

from __future__ import annotations

from typing import Any

from omegaconf import ListConfig

from specdistill.data.heldout_check import HELDOUT_FIX, shared_rows, why_shared
from specdistill.data.runtime import ConfigError
from specdistill.data.splits import EVAL, TRAIN

EVAL_SOURCES = ("reference", "target")  # distill eval rows read from the dataset (not eval.path)


def check_heldout_plan(steps: list[Any]) -> None:
    """One `error:` line naming the steps whose evaluation rows may be training rows, the split
    they share and the fix; nothing when every evaluation reads held-out rows."""
    generated = {s.out_dir: s for s in steps if s.stage == "generate"}
    found: dict[tuple[str, str, str], list[str]] = {}  # (trainer, where, why) -> readers
    for step in steps:
        for reader, evaluation, trainer, training in _pairs(step, generated):
            for train_side, eval_side in shared_rows(*training, *evaluation):
                key = (trainer, eval_side.where(), why_shared(train_side, eval_side))
                if reader not in found.setdefault(key, []):
                    found[key].append(reader)
    if not found:
        return
    (trainer, where, why), readers = next(iter(found.items()))
    others = len(found) - 1
    more = f" (and {others} more)" if others else ""
    raise ConfigError(
        f"{', '.join(readers)} would evaluate on rows that {trainer} trains on: {where}, {why}"
        f"{more}; validate would refuse them only after generate and distill ran. Fix the set "
        f"(conf/dataset/): {HELDOUT_FIX}; or train on another set (generate.dataset=NAME)"
    )


def _paths(value: Any) -> list[Any]:
    """A step's hand-off paths: one folder, or a list of them (distill over several generate
    steps, as the chat modes' pipeline plans it)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]


def _pairs(step: Any, generated: dict[str, Any]) -> list[tuple[str, tuple, str, tuple]]:
    """(reader, (its dataset, role), trainer, (the training dataset, role)) for one step."""
    cfg = step.config
    if step.stage == "validate":
        gens = [generated[p] for p in _paths(cfg.get("training_data")) if p in generated]
        return [(step.name, (cfg["dataset"], EVAL), g.name, _generated(g)) for g in gens]
    if step.stage != "distill" or cfg["eval"]["source"] not in EVAL_SOURCES:
        return []
    data = cfg["data"]
    split = cfg["eval"]["split"]  # distill reads its eval rows from eval.split, whatever the set's
    evaluation = ({**cfg["dataset"], "split": split}, split)
    paths = _paths(data.get("path"))
    if paths:
        # rows from elsewhere than a generate step: validate's run-time check is what sees them
        gens = [generated[p] for p in paths if p in generated]
        return [(f"{step.name} (eval)", evaluation, g.name, _generated(g)) for g in gens]
    if data.get("seq_kd") or data.get("reference"):
        trainer, training = f"{step.name} (its own Seq-KD rows)", (cfg["dataset"], TRAIN)
        return [(f"{step.name} (eval)", evaluation, trainer, training)]
    return []


def _generated(gen: Any) -> tuple[Any, str]:
    """A generate step's dataset and the role it reads it for (its `split`)."""
    return gen.config["dataset"], str(gen.config.get("split") or TRAIN)
