"""The run's state between optimizer steps: fresh (evaluated at step 0) or resumed from the
latest checkpoint, the held-out evaluation on schedule (best/ follows its score) and the
resumable checkpoints. `state` is a plain dict so that it travels inside a checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import checkpoint as ckpt

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer

log = logging.getLogger("specdistill.distill")


# Keys that do not change what a run computes: a rerun may change them and still resume.
RUN_ONLY = ("resume", "output_dir", "logger", "log_every", "keep_checkpoints", "hydra")


def run_config(cfg: Any) -> dict[str, Any]:
    """The stage config as flat `dotted.key: value` pairs, less `RUN_ONLY`: what a checkpoint
    records so that `resume: auto` continues only the same run."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        try:
            tree = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an interpolation only the stage resolves: compare it as written
            tree = OmegaConf.to_container(cfg, resolve=False)
    else:
        tree = dict(cfg)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    walk({k: v for k, v in tree.items() if k not in RUN_ONLY}, "")
    return flat


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: saved -> now` for every key that differs (a key only one side has included)."""
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def resume_point(config: dict[str, Any], s: Any) -> Any:
    """The checkpoint this run continues from (None: start afresh), per `resume`, from the
    files alone, before anything loads: a checkpoint of another config (`config`, this run's
    `run_config`) under `resume: auto` is one error line naming what changed."""
    root = Path(s.output_dir) / "checkpoints"
    latest = None if s.resume is False else ckpt.latest_checkpoint(root)
    if latest is None:
        if s.resume is True:
            log.warning("resume=true but no checkpoint in %s: starting fresh", root)
        return None
    saved = ckpt.read_state(latest).get("config")
    if s.resume == "auto" and saved is not None:
        changed = config_changes(saved, config)
        if changed:
            shown = "; ".join(changed[:4]) + (
                f"; and {len(changed) - 4} more" if changed[4:] else ""
            )
            raise ConfigError(
                f"output_dir={s.output_dir} holds a checkpoint ({latest.name}) of another config "
                f"({shown}): resume=true continues from it anyway, resume=false starts afresh "
                "over it, or use a fresh output_dir"
            )
    return latest


def start_or_resume(tr: Trainer, latest: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The run's state: restored from checkpoint `latest` (`resume_point`), or fresh (evaluated
    at step 0) when it is None; `config` (`run_config`, taken before anything loaded) is what
    its checkpoints record."""
    accelerator = tr.accelerator
    if latest is not None:
        state = ckpt.load_checkpoint(accelerator, latest, tr.sharded)
        if state["stream"] != tr.stream.layout:
            raise ConfigError(
                f"resume={str(tr.s.resume).lower()} but the data layout changed since {latest} "
                f"({state['stream']} vs {tr.stream.layout}): keep the data, micro_batch_size, "
                "grad_accum, process count and seed, or start a fresh output_dir (resume=false)"
            )
        state["config"] = config
        log.info("resumed from %s at step %d", latest, state["step"])
        return state
    before = tr.evaluate()
    state = {
        "step": 0,
        "tokens": 0,
        "train_seconds": 0.0,
        "history": [],
        "before": before,
        "best_alpha": before["alpha"],
        "best_score": score(before),
        "best_step": 0,
        "config": config,
    }
    ckpt.export_pretrained(accelerator, tr.model, tr.out_tok, tr.out / "best")
    accelerator.log(
        {"eval/alpha": before["alpha"], "eval/greedy": before["greedy_agreement"]}, step=0
    )
    return state


def score(ev: dict[str, Any]) -> float:
    """What best/ follows: held-out alpha, or for a parallel drafter the expected accepted drafts
    per round over all its depths (depth 1 alone would favour the autoregressive start)."""
    return float(ev.get("accepted_length", ev["alpha"]))


def evaluate_and_save(
    tr: Trainer, state: dict[str, Any], rec: dict[str, Any], t_train: float, save: bool = False
) -> float:
    """Held-out eval (best/ follows the best alpha) and the resumable checkpoint, on schedule;
    `save` (a stop signal, train/preempt.py) checkpoints this step off schedule.

    Returns the time the next training stretch starts from (checkpoint time is not training).
    """
    s, step = tr.s, rec["step"]
    last = step == s.max_steps
    if step % s.eval_every == 0 or last:
        ev = tr.evaluate()
        rec |= {"alpha": ev["alpha"], "greedy_agreement": ev["greedy_agreement"]}
        if "alpha_at" in ev:
            rec |= {"alpha_at": ev["alpha_at"], "accepted_length": ev["accepted_length"]}
            rec["round_accepted"] = ev.get("round_accepted")
        if score(ev) > state.get("best_score", state["best_alpha"]):
            state["best_alpha"], state["best_step"] = ev["alpha"], step
            state["best_score"] = score(ev)
            ckpt.export_pretrained(tr.accelerator, tr.model, tr.out_tok, tr.out / "best")
    state["history"].append(rec)
    tr.accelerator.log({f"train/{k}" if k != "step" else k: v for k, v in rec.items()}, step=step)
    if step % s.save_every == 0 or last or save:
        state["step"] = step
        state["examples_seen"] = tr.stream.examples_seen(step)
        state["stream"] = tr.stream.layout
        state["train_seconds"] += time.perf_counter() - t_train
        t_train = time.perf_counter()
        root = tr.out / "checkpoints"
        ckpt.save_checkpoint(tr.accelerator, root, step, state, s.keep_checkpoints, tr.sharded)
    return t_train
