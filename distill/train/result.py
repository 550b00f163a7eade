"""The distill stage's result: `DistillResult` (what result.json holds) and `finish`, which
writes final/, the held-out decode prediction of best/, result.json and a sweep's summary.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from specdistill.data.io import atomic_write_json
from specdistill.distill.train import checkpoint as ckpt
from specdistill.distill.train.data import chat_record, prompts_cut
from specdistill.distill.train.predict import heldout_prediction
from specdistill.distill.train.sweep_summary import write_summary

if TYPE_CHECKING:
    from specdistill.distill.train.trainer import Trainer


@dataclass
class DistillResult:
    output_dir: str
    drafter_path: str
    final_path: str
    alpha_before: float
    alpha_after: float
    greedy_agreement_before: float
    greedy_agreement_after: float
    best_alpha: float
    best_step: int
    steps: int
    tokens: int
    tokens_per_s: float
    wall_seconds: float
    peak_memory_mb: float
    peak_memory_kind: str
    loss: dict[str, Any]
    lmbda: float
    data: dict[str, Any]
    world_size: int
    history: list[dict[str, float]] = field(default_factory=list)
    switch: dict[str, Any] | None = None  # the second phase, when the run had one
    # decode figures of best/ predicted from the held-out set (distill/train/predict.py)
    heldout_prediction: dict[str, Any] | None = None
    # drafting=parallel: mask token, depth, per-depth held-out acceptance before/after
    parallel: dict[str, Any] | None = None


def peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def _best_drafter(tr: Trainer, state: dict[str, Any], step: int):
    """best/ as a model: the one in memory when the last step was the best, else from disk."""
    if state["best_step"] == step and tr.spread.holds_whole_model:
        return tr.accelerator.unwrap_model(tr.model)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tr.out / "best").to(tr.device)


def finish(tr: Trainer, state: dict[str, Any], step: int) -> DistillResult:
    """final/, the result (written by the main process) and the sweep summary if any."""
    cfg, s, out = tr.cfg, tr.s, tr.out
    ckpt.export_pretrained(tr.accelerator, tr.model, tr.out_tok, out / "final")
    after = next((h for h in reversed(state["history"]) if "alpha" in h), None)
    before = state["before"]
    peak, peak_kind = peak_memory(tr.device)
    result = DistillResult(
        output_dir=str(out),
        drafter_path=str(out / "best"),
        final_path=str(out / "final"),
        alpha_before=before["alpha"],
        alpha_after=after["alpha"] if after else before["alpha"],
        greedy_agreement_before=before["greedy_agreement"],
        greedy_agreement_after=after["greedy_agreement"] if after else before["greedy_agreement"],
        best_alpha=state["best_alpha"],
        best_step=state["best_step"],
        steps=step,
        tokens=state["tokens"],
        tokens_per_s=state["tokens"] / max(state["train_seconds"], 1e-9),
        wall_seconds=time.perf_counter() - tr.t_start,
        peak_memory_mb=peak,
        peak_memory_kind=peak_kind,
        # `loss` and `switch`: the config's own sections, echoed as given
        loss=OmegaConf.to_container(cfg.loss, resolve=True),  # type: ignore[arg-type]
        lmbda=s.lmbda,
        data={
            "path": ", ".join(s.data.paths) or str(out / "seqkd" if s.data.seq_kd else ""),
            "reference": s.data.reference,
            "topk": tr.topk,
            "frozen_params": tr.frozen_params,
            "draft_vocab": len(getattr(unwrapped_config(tr), "draft_vocab_ids", None) or ()),
            "draft_vocab_train": tr.head_ids is not None,
            # the draft vocabulary's greedy mask (a mapped pair's summary below carries its own)
            **({"tli_mask_unreachable": s.mask_unreachable} if tr.head_ids is not None else {}),
            "train_examples": len(tr.train_examples),
            # rows longer than max_seq_len: their prompt cut (the end kept, a chat row's head too)
            "prompts_cut": prompts_cut(tr.train_examples, s.max_seq_len),
            **chat_record(s.data.paths or (out / "seqkd" if s.data.seq_kd else None)),
            "eval_tokens": before["tokens"],
            "eval_source": s.eval.source,
            "eval_sampling": tr.eval_sampling.as_dict(),
            **tr.objective.result_data(),
        },
        world_size=tr.accelerator.num_processes,
        history=state["history"],
        switch=OmegaConf.to_container(cfg.switch) if s.switch.at else None,  # type: ignore[arg-type]
        parallel=tr.objective.result_parallel(tr, state, after),
    )
    if tr.accelerator.is_main_process:
        if tr.objective.predicts_decode:  # autoregressive drafts in shared ids (predict.py)
            result.heldout_prediction = heldout_prediction(tr, _best_drafter(tr, state, step), s)
        atomic_write_json(out / "result.json", result)
        if s.sweep_dir:
            write_summary(Path(s.sweep_dir))
    if tr.rollouts is not None:  # before the process group ends (train/rollouts.py)
        tr.rollouts.close()
    tr.accelerator.end_training()
    return result


def unwrapped_config(tr: Trainer):
    return tr.accelerator.unwrap_model(tr.model).config
