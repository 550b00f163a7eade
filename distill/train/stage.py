"""The distill stage: train the drafter q towards the frozen target p (DistillSpec / GKD).

    python -m specdistill.distill.train pair=toy-tiny output_dir=DIR max_steps=50
    torchrun --nproc_per_node 2 -m specdistill.distill.train ... [deepspeed=zero2|zero3 | fsdp=true]

Data sources mix (Seq-KD rows, reference completions, on-policy drafter samples with
probability `lmbda` per micro-batch); the target runs on the fly (frozen, no grad) unless the
Seq-KD rows carry stored top-k log-probs. The loss is summed over completion tokens and divided
by the token count of the whole accumulation window across processes, so 2 processes x 1
micro-batch train exactly like 1 process x 2. Writes `output_dir/result.json`, `best/` (the
best held-out alpha: the drafter to ship), `final/` and resumable `checkpoints/`: a rerun of
the same config continues from the latest, and SIGTERM / SIGUSR1 save one first (preempt.py).

`run` is the loop; its pieces live beside it: the settings (train/settings.py), `prepare` and
the `Trainer` it builds (train/trainer.py), the run's two parts chosen once (train/parts.py:
what the drafter is trained against, train/objective.py, and how it is spread over processes,
train/spread.py), one optimizer step (train/step.py), the state between steps
(train/progress.py) and the result (train/result.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import hydra
from omegaconf import DictConfig
from tqdm.auto import tqdm

from specdistill.data.runtime import run_or_exit
from specdistill.data.stage_config import check_command_line
from specdistill.distill.train.preempt import StopRequest
from specdistill.distill.train.progress import (
    evaluate_and_save,
    resume_point,
    run_config,
    start_or_resume,
)
from specdistill.distill.train.result import DistillResult, finish
from specdistill.distill.train.settings import TrainSettings, removed_keys
from specdistill.distill.train.step import train_step
from specdistill.distill.train.trainer import Trainer, prepare

__all__ = ["DistillResult", "Trainer", "main", "prepare", "run", "train_step"]

# Test hook: called as STEP_HOOK(step) after every optimizer step (and its checkpoint), e.g. to
# simulate a crash at a chosen step.
STEP_HOOK: Callable[[int], None] | None = None


def run(cfg: DictConfig) -> DistillResult:
    """Distill the pair's drafter; see the module docstring."""
    s = TrainSettings.from_cfg(cfg)  # every check of the stage's own settings, before any load
    config = run_config(cfg)  # what its checkpoints record, so that a rerun knows its own
    latest = resume_point(config, s)  # the checkpoint this run continues (resume: auto), if any
    tr = prepare(cfg, s)
    stop = StopRequest().install()  # SIGTERM / SIGUSR1 / SIGUSR2: save at the next step, exit
    try:
        state = start_or_resume(tr, latest, config)
        step, max_steps = int(state["step"]), s.max_steps
        bar = tqdm(
            total=max_steps,
            initial=step,
            disable=not tr.accelerator.is_main_process,
            desc=f"distill[{s.loss.name}]",
            dynamic_ncols=True,
        )
        t_train = time.perf_counter()
        while step < max_steps:
            rec = train_step(tr, step)
            step = rec["step"]
            state["tokens"] += rec["tokens"]
            signum = stop.agreed(tr.accelerator)
            t_train = evaluate_and_save(tr, state, rec, t_train, save=bool(signum))
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", alpha=f"{state['best_alpha']:.3f}")
            if STEP_HOOK is not None:
                STEP_HOOK(step)
            if signum and step < max_steps:  # saved above; the last step finishes instead
                bar.close()
                stop.exit(signum)
        bar.close()
        state["train_seconds"] += time.perf_counter() - t_train
        return finish(tr, state, step)
    finally:
        stop.restore()


@hydra.main(config_path="pkg://specdistill.conf", config_name="distill", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    res = run_or_exit(run, cfg)
    print(
        f"distill: alpha {res.alpha_before:.4f} -> {res.alpha_after:.4f} "
        f"(best {res.best_alpha:.4f} at step {res.best_step}); drafter: {res.drafter_path}"
    )


def main() -> None:
    """`python -m specdistill.distill.train`: a removed or unknown key on the command line is
    one `error:` line (exit 2) before Hydra composes the config, then Hydra's main runs it."""
    check_command_line("distill", removed_keys())
    _hydra_main()


if __name__ == "__main__":
    main()
