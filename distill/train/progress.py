"""The run's state between optimizer steps: fresh (evaluated at step 0) or resumed from the
latest checkpoint, the held-out evaluation on schedule (best/ follows its score) and the
resumable checkpoints. `state` is a plain dict so that it travels inside a checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import checkpoint as ckpt

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer

log = logging.getLogger("specdistill.distill")


def start_or_resume(tr: Trainer) -> dict[str, Any]:
    """The run's state: restored from the latest checkpoint, or fresh (evaluated at step 0)."""
    accelerator = tr.accelerator
    root = tr.out / "checkpoints"
    latest = ckpt.latest_checkpoint(root) if tr.s.resume else None
    if latest is not None:
        state = ckpt.load_checkpoint(accelerator, latest)
        if state["stream"] != tr.stream.__dict__:
            raise ConfigError(
                f"resume=true but the data layout changed since {latest} "
                f"({state['stream']} vs {tr.stream.__dict__}): keep the data, micro_batch_size, "
                "grad_accum, process count and seed, or start a fresh output_dir"
            )
        log.info("resumed from %s at step %d", latest, state["step"])
        return state
    if tr.s.resume:
        log.warning("resume=true but no checkpoint in %s: starting fresh", root)
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
    tr: Trainer, state: dict[str, Any], rec: dict[str, Any], t_train: float
) -> float:
    """Held-out eval (best/ follows the best alpha) and the resumable checkpoint, on schedule.

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
    if step % s.save_every == 0 or last:
        state["step"] = step
        state["examples_seen"] = tr.stream.examples_seen(step)
        state["stream"] = tr.stream.__dict__
        state["train_seconds"] += time.perf_counter() - t_train
        t_train = time.perf_counter()
        root = tr.out / "checkpoints"
        ckpt.save_checkpoint(tr.accelerator, root, step, state, s.keep_checkpoints)
    return t_train
