"""Distill-stage set-up: the machine's checks, the accelerator's arguments, the target, the
draft vocabulary, frozen embeddings and gradient checkpointing, the logger.

The stage's settings are typed and checked by `TrainSettings.from_cfg` (train/settings.py);
what depends on this machine is checked here (`check_config`), and the data sources
(train/sources.py) raise a ConfigError naming the field for what only the files can tell (no
rows, no stored top-k), all before any model trains.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.models.pairs import (
    PairSpec,
    check_same_tokenizer,
    check_vocab,
    load_role,
    vocab_size,
)
from specdistill.data.prompts import check_prompt_settings
from specdistill.data.runtime import ConfigError, parse_dtype
from specdistill.decode.draft_vocab import (
    CONFIG_KEY,
    draft_vocab_size,
    drafter_vocab_ids,
)
from specdistill.distill.train import fsdp, rollouts, zero
from specdistill.distill.train.example import Example
from specdistill.distill.train.seqkd_rows import token_arrays
from specdistill.distill.train.settings import TrainSettings

if TYPE_CHECKING:
    from specdistill.distill.train.objective import Objective

log = logging.getLogger(__name__)


def check_settings(cfg: DictConfig, s: TrainSettings | None = None) -> TrainSettings:
    """The checks that need the config alone, so the pipeline's plan runs them for every
    distill step before the first one starts: the settings typed (`TrainSettings.from_cfg`,
    unless `s` already is), the prompt set's keys, and how the drafter is sharded and rolled
    out as the config states it (`check_sharding` with `pair.vocab`)."""
    s = s or TrainSettings.from_cfg(cfg)
    if cfg.get("dataset") is not None:
        check_prompt_settings(cfg.dataset)
    check_sharding(s, str((cfg.get("pair") or {}).get("vocab", "auto")) == "mapped")
    return s


def check_sharding(s: TrainSettings, mapped: bool) -> str:
    """FSDP2's refusals (train/fsdp.py) and the on-policy engine the config asks for
    (train/rollouts.py: vLLM asked for where it cannot serve is refused, `auto` there stays in
    transformers); returns that engine, for `resolve_engine` to decide by machine."""
    parallel = s.parallel is not None
    asked = rollouts.asked_engine(
        s.onpolicy.engine, s.most_onpolicy > 0, s.zero_stage, mapped, parallel, s.fsdp
    )
    fsdp.check_fsdp(s.fsdp, s.deepspeed, mapped, parallel)
    return asked


def check_config(cfg: DictConfig, s: TrainSettings | None = None) -> TrainSettings:
    """Every check before anything loads: `check_settings`, then what depends on this machine
    (DeepSpeed's offload devices, fp16 on CPU: train/zero.py)."""
    s = check_settings(cfg, s)
    zero.check_deepspeed(cfg, use_cuda(s))
    return s


def set_draft_vocab(
    setting: Any, drafter, examples: Sequence[Example], tok, mask_id: int | None
) -> int:
    """Store the decode-time draft vocabulary (decode.draft_vocab) in the drafter's config, from
    the training rows' token counts, so every checkpoint it saves carries it. `setting`:
    `draft_vocab` (auto | none | N). Returns its size."""
    vocab = drafter.get_output_embeddings().weight.shape[0]
    size = draft_vocab_size(setting, vocab)
    if size == 0 or size >= vocab:
        if setting in ("none", 0) or size >= vocab:  # an earlier run's list would be stale
            drafter.config.__dict__.pop(CONFIG_KEY, None)
        return 0
    always = [t for t in (tok.eos_token_id,) if t is not None]
    ids = drafter_vocab_ids(token_arrays(examples), vocab, size, always, mask_id)
    setattr(drafter.config, CONFIG_KEY, ids)
    return len(ids)


def checkpoint_layers(model) -> None:
    """`gradient_checkpointing`: each decoder layer's activations recomputed in backward, not
    kept. Non-reentrant: with frozen embeddings the first layer's input needs no gradient, and
    a reentrant checkpoint would then return none for the layers either."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"gradient_checkpointing=true: {type(model).__name__} has no gradient checkpointing "
            "in transformers; set gradient_checkpointing=false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze_embeddings(s: TrainSettings, pair: Any, model, objective: Objective) -> int:
    """Freeze the drafter's input embeddings and LM head (`freeze_embeddings`), as the objective
    freezes them; the number of parameters frozen.

    A drafter built from the target's layers starts with the target's own embeddings and head;
    the layers are what has to learn. With a vocabulary of 49k and hidden 576 the (tied) head
    is 28M of SmolLM2 first:4's 42.5M parameters, so training it costs a [V, H] weight gradient
    per micro-batch and 2 x 28M AdamW moments per step for little gain. `auto`: on exactly
    when `pair.drafter_layers` builds the drafter. A parallel drafter keeps its mask token's
    row trainable (train/parallel_drafting.py).
    """
    mode = s.freeze_embeddings
    if mode == "auto":
        mode = OmegaConf.select(pair, "drafter_layers") is not None
    return objective.freeze_embeddings(model) if mode else 0


def use_cuda(s: TrainSettings) -> bool:
    return torch.cuda.is_available() and s.device != "cpu"


def accelerator_kwargs(s: TrainSettings, cfg: DictConfig) -> dict[str, Any]:
    """accelerate's Accelerator arguments every spread shares (train/spread.py builds it).
    accelerate handles devices and processes; our own loop does the accumulation (so the loss
    can be normalised by the window's tokens), except under DeepSpeed, whose engine must own
    the accumulation boundary (train/zero.py)."""
    mp = s.mixed_precision
    if mp == "auto":
        mp = "bf16" if use_cuda(s) else "no"
    kwargs: dict[str, Any] = {"mixed_precision": mp, "cpu": not use_cuda(s)}
    if cfg.logger.name == "wandb":
        kwargs["log_with"] = "wandb"
        kwargs["project_dir"] = str(s.output_dir)
    return kwargs


def init_logger(accelerator, cfg: DictConfig) -> None:
    """wandb: project/run name/config from Hydra; offline when no API key is configured."""
    if cfg.logger.name != "wandb":
        return
    mode = os.environ.get("WANDB_MODE") or cfg.logger.mode
    if mode == "auto":
        netrc = Path.home() / ".netrc"
        has_key = bool(os.environ.get("WANDB_API_KEY")) or (
            netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
        )
        mode = "online" if has_key else "offline"
    name = cfg.logger.run_name or f"{cfg.loss.name}-{Path(str(cfg.output_dir)).name}"
    accelerator.init_trackers(
        cfg.logger.project,
        config=OmegaConf.to_container(cfg, resolve=True),
        init_kwargs={"wandb": {"name": name, "dir": str(cfg.output_dir), "mode": mode}},
    )


def load_target(spec: PairSpec, s: TrainSettings, device, drafter, tokenizer):
    """The frozen target: eval mode, no grad, bf16 on GPU; vocab and tokenizer checked."""
    dtype = parse_dtype(s.target_dtype, device)
    target = load_role(spec, "target", dtype=dtype, device=device)
    target.requires_grad_(False)
    check_vocab(vocab_size(target), vocab_size(drafter), len(tokenizer))
    from transformers import AutoTokenizer

    try:
        drafter_tok = AutoTokenizer.from_pretrained(spec.drafter, revision=spec.drafter_revision)
    except (OSError, ValueError):
        drafter_tok = None
    if drafter_tok is not None:
        check_same_tokenizer(tokenizer, drafter_tok)
    return target
