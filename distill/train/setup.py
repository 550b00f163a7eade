"""Distill-stage set-up: config checks, the accelerator, models and data sources.

Everything that can be wrong with the user's input is checked here, before any model trains,
with a ConfigError that names the config field.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.models.pairs import (
    PairSpec,
    check_same_tokenizer,
    check_vocab,
    load_role,
    vocab_size,
)
from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError, parse_dtype
from specdistill.data.sampling import Sampling
from specdistill.decode.draft_vocab import (
    CONFIG_KEY,
    draft_vocab_size,
    drafter_vocab_ids,
)
from specdistill.distill.head_loss import AUTO_MIN_VOCAB
from specdistill.distill.losses import DIVERGENCES
from specdistill.distill.parallel import check_parallel_config
from specdistill.distill.train import zero
from specdistill.distill.train.data import Example, has_topk, load_seqkd, reference_examples

log = logging.getLogger(__name__)


def check_config(cfg: DictConfig) -> None:
    """Reject bad settings up front, naming the field."""
    for field in ("lmbda", "loss.beta"):
        value = OmegaConf.select(cfg, field)
        if value is None or not 0.0 <= float(value) <= 1.0:
            raise ConfigError(f"{field}={value} must lie in [0, 1] (see DESIGN.md: GKD naming)")
    if cfg.loss.name not in DIVERGENCES:
        raise ConfigError(f"loss.name={cfg.loss.name!r} is not one of {', '.join(DIVERGENCES)}")
    if float(cfg.loss.temperature) <= 0:
        raise ConfigError(f"loss.temperature={cfg.loss.temperature} must be positive")
    for field in ("max_steps", "micro_batch_size", "grad_accum", "eval_every", "save_every"):
        if int(OmegaConf.select(cfg, field)) <= 0:
            raise ConfigError(f"{field}={OmegaConf.select(cfg, field)} must be a positive integer")
    if int(cfg.max_seq_len) < 2:
        raise ConfigError(f"max_seq_len={cfg.max_seq_len} must be at least 2")
    if cfg.loss_chunk_size is not None and int(cfg.loss_chunk_size) <= 0:
        raise ConfigError(f"loss_chunk_size={cfg.loss_chunk_size} must be positive or null")
    if cfg.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision={cfg.mixed_precision!r}: use auto, no, bf16 or fp16")
    if cfg.freeze_embeddings not in ("auto", True, False):
        raise ConfigError(f"freeze_embeddings={cfg.freeze_embeddings!r}: use auto, true or false")
    if cfg.eval.source not in ("reference", "path", "target"):
        raise ConfigError(f"eval.source={cfg.eval.source!r}: use reference, path or target")
    eval_sampling(cfg)
    onpolicy_sampling(cfg)
    check_switch(cfg)
    zero.check_deepspeed(cfg, use_cuda(cfg))
    drafting = cfg.get("drafting", "autoregressive")
    if drafting not in ("autoregressive", "parallel"):
        raise ConfigError(f"drafting={drafting!r}: use autoregressive or parallel")
    if drafting == "parallel":
        check_parallel_config(cfg.parallel)
    if cfg.optim.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"optim.schedule={cfg.optim.schedule!r}: use cosine, linear or constant")
    draft_vocab_size(cfg.get("draft_vocab", "auto"), 1 << 30)  # the setting's form only
    chunked_loss(cfg, 0)


def chunked_loss(cfg: DictConfig, vocab: int) -> bool:
    """`chunked_loss`: compute the loss from the drafter's hidden states and head in chunks of
    positions, never the full [N, V] logits (distill/head_loss.py; exact, same value). auto: on
    for vocabularies >= head_loss.AUTO_MIN_VOCAB, where the head's logits dominate a step
    (distill/RESULTS.md). Applies to the plain-process masked-head path (`masked_head`) of a
    plain-head model; the draft-vocabulary head (`draft_vocab_train`) keeps its own path."""
    setting = cfg.get("chunked_loss", "auto")
    if setting not in ("auto", True, False):
        raise ConfigError(f"chunked_loss={setting!r}: use auto, true or false")
    return vocab >= AUTO_MIN_VOCAB if setting == "auto" else bool(setting)


def train_head_ids(
    cfg: DictConfig, drafter, topk: bool, mask_id: int | None, device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(ids, token -> column index) when the drafter trains on its draft vocabulary
    (`draft_vocab_train=true`): the loss then sees q over the subset, the distribution our
    decoder drafts from, and the head's matmul and gradient shrink by V / K. Off by default:
    logits outside the subset are never trained down, so engines that run the full head (vLLM,
    `transformers`) draft badly with it (figures: distill/RESULTS.md, 2026-11-25 "training over
    the draft vocabulary"). Only stored
    top-k rows of an autoregressive drafter use it; other paths keep the full head."""
    setting = cfg.get("draft_vocab_train", False)
    if setting not in (True, False):
        raise ConfigError(f"draft_vocab_train={setting!r}: use true or false")
    ids = getattr(drafter.config, CONFIG_KEY, None)
    if not setting or not ids or not topk or mask_id is not None:
        return None, None
    rows = drafter.get_output_embeddings().weight.shape[0]
    head_ids = torch.tensor(ids, dtype=torch.long, device=device)
    index = torch.full((rows,), len(ids), dtype=torch.long, device=device)
    index[head_ids] = torch.arange(len(ids), device=device)
    return head_ids, index


def set_draft_vocab(cfg: DictConfig, drafter, examples: list, tok, mask_id: int | None) -> int:
    """Store the decode-time draft vocabulary (decode.draft_vocab) in the drafter's config, from
    the training rows' token counts, so every checkpoint it saves carries it. Returns its size."""
    setting = cfg.get("draft_vocab", "auto")
    vocab = drafter.get_output_embeddings().weight.shape[0]
    size = draft_vocab_size(setting, vocab)
    if size == 0 or size >= vocab:
        if setting in ("none", 0) or size >= vocab:  # an earlier run's list would be stale
            drafter.config.__dict__.pop(CONFIG_KEY, None)
        return 0
    always = [t for t in (tok.eos_token_id,) if t is not None]
    seqs = (s for e in examples for s in (e.prompt_ids, e.completion_ids))
    ids = drafter_vocab_ids(seqs, vocab, size, always, mask_id)
    setattr(drafter.config, CONFIG_KEY, ids)
    return len(ids)


def check_switch(cfg: DictConfig) -> None:
    """`switch`: an optional second phase (e.g. greedy Seq-KD + FKL, then on-policy TVD)."""
    sw = OmegaConf.select(cfg, "switch")
    if sw is None or sw.get("at") is None:
        return
    at = float(sw.at)
    if not 0.0 < at < 1.0:
        raise ConfigError(f"switch.at={at} must lie in (0, 1): the share of max_steps before it")
    if sw.get("loss") is not None and sw.loss not in DIVERGENCES:
        raise ConfigError(f"switch.loss={sw.loss!r} is not one of {', '.join(DIVERGENCES)}")
    for field in ("lmbda", "beta"):
        v = sw.get(field)
        if v is not None and not 0.0 <= float(v) <= 1.0:
            raise ConfigError(f"switch.{field}={v} must lie in [0, 1] or be null")


def phase_at(cfg: DictConfig, step: int) -> tuple[str, float, float]:
    """(loss name, beta, lmbda) for optimizer step `step` (0-based): the switch's settings
    from step int(switch.at * max_steps) on, the stage's own before (or without a switch)."""
    sw = OmegaConf.select(cfg, "switch")
    name, beta, lmbda = str(cfg.loss.name), float(cfg.loss.beta), float(cfg.lmbda)
    if sw is None or sw.get("at") is None or step < int(float(sw.at) * int(cfg.max_steps)):
        return name, beta, lmbda
    if sw.get("loss") is not None and sw.loss != name:
        name, beta = str(sw.loss), {"fkl": 0.0, "rkl": 1.0}.get(str(sw.loss), 0.5)
    if sw.get("beta") is not None:
        beta = float(sw.beta)
    if sw.get("lmbda") is not None:
        lmbda = float(sw.lmbda)
    return name, beta, lmbda


def eval_sampling(cfg: DictConfig) -> Sampling:
    """The serving mode the held-out acceptance is measured in (temperature 0 = greedy)."""
    return Sampling.from_parent(cfg.eval, "eval.sampling")


def onpolicy_sampling(cfg: DictConfig) -> Sampling:
    """How the drafter samples its on-policy batches (temperature 0 = its greedy output)."""
    return Sampling.from_parent(cfg.onpolicy, "onpolicy.sampling")


def freeze_embeddings(cfg: DictConfig, model) -> int:
    """Freeze the drafter's input embeddings and LM head (`freeze_embeddings`); the number of
    parameters frozen.

    A drafter built from the target's layers starts with the target's own embeddings and head;
    the layers are what has to learn. With a vocabulary of 49k and hidden 576 the (tied) head
    is 28M of SmolLM2 first:4's 42.5M parameters, so training it costs a [V, H] weight gradient
    per micro-batch and 2 x 28M AdamW moments per step for little gain. `auto`: on exactly
    when `pair.drafter_layers` builds the drafter, and off for `drafting=parallel` (the mask
    token's embedding row is what a parallel drafter learns first).
    """
    mode = cfg.freeze_embeddings
    if mode == "auto":
        parallel = str(cfg.get("drafting", "autoregressive")) == "parallel"
        mode = OmegaConf.select(cfg, "pair.drafter_layers") is not None and not parallel
    if not mode:
        return 0
    frozen: dict[int, torch.nn.Parameter] = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is None:
            continue
        for param in module.parameters():
            param.requires_grad_(False)
            frozen[id(param)] = param  # a tied head is the embedding's tensor: counted once
    return sum(p.numel() for p in frozen.values())


def use_cuda(cfg: DictConfig) -> bool:
    return torch.cuda.is_available() and cfg.device != "cpu"


def make_accelerator(cfg: DictConfig):
    """accelerate handles devices and processes; our own loop does the accumulation (so the
    loss can be normalised by the window's tokens), except under DeepSpeed, whose engine must
    own the accumulation boundary (see `zero`)."""
    from accelerate import Accelerator

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if use_cuda(cfg) else "no"
    kwargs: dict[str, Any] = {"mixed_precision": mp, "cpu": not use_cuda(cfg)}
    if cfg.logger.name == "wandb":
        kwargs["log_with"] = "wandb"
        kwargs["project_dir"] = str(cfg.output_dir)
    if cfg.deepspeed.enabled:
        return zero.make_deepspeed_accelerator(cfg, use_cuda(cfg), kwargs)
    return Accelerator(**kwargs)


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


def load_target(spec: PairSpec, cfg: DictConfig, device, drafter, tokenizer):
    """The frozen target: eval mode, no grad, bf16 on GPU; vocab and tokenizer checked."""
    dtype = parse_dtype(cfg.target_dtype, device)
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


def _dataset_cfg(cfg: DictConfig, split: str | None) -> DictConfig:
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if split is not None:
        ds["split"] = split
    return OmegaConf.create(ds)


def build_seqkd(cfg: DictConfig, accelerator) -> Path:
    """Run the generate stage into output_dir/seqkd (main process; reused when complete)."""
    overrides = OmegaConf.to_container(cfg.data.generate, resolve=True)
    return run_generate(cfg, accelerator, Path(str(cfg.output_dir)) / "seqkd", "train", overrides)


def run_generate(
    cfg: DictConfig, accelerator, path: Path, split: str, settings: dict[str, Any]
) -> Path:
    """The generate stage over the dataset's `split` into `path` (main process; a finished
    run with the same config is reused by the generate stage itself)."""
    if accelerator.is_main_process:
        try:
            from specdistill.data.generate.stage import run as generate
        except ImportError as e:
            raise ConfigError(
                "the generate stage is not available to build target continuations: pass "
                "data.path / eval.path, or data.seq_kd=false with data.reference=true"
            ) from e
        from hydra import compose, initialize_config_module
        from hydra.core.global_hydra import GlobalHydra

        overrides = [f"output_dir={path}", f"split={split}", f"seed={cfg.seed}"]
        if GlobalHydra.instance().is_initialized():
            gcfg = compose(config_name="generate", overrides=overrides)
        else:
            with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
                gcfg = compose(config_name="generate", overrides=overrides)
        try:  # merged, not written as overrides: nested settings (`sampling`) keep their shape
            gcfg = OmegaConf.merge(gcfg, settings)
        except Exception as e:  # a key the generate stage does not have
            raise ConfigError(f"data.generate: {e}".splitlines()[0]) from e
        OmegaConf.set_struct(gcfg, False)
        gcfg.pair = cfg.pair
        gcfg.dataset = _dataset_cfg(cfg, None)
        if split != "train":
            gcfg.dataset.limit = cfg.eval.limit
        gcfg.shard = {"index": 0, "count": 1}
        gcfg.progress = False
        if cfg.device == "cpu":
            gcfg.device = "cpu"
        log.info("target continuations (%s split) with the generate stage -> %s", split, path)
        generate(gcfg)
    accelerator.wait_for_everyone()
    return path


def build_train_examples(cfg: DictConfig, tokenizer, accelerator) -> tuple[list[Example], bool]:
    """(examples, top-k mode). Sources mix: Seq-KD rows + reference completions; with
    lmbda = 1 and neither, the dataset's prompts alone (every batch is drafter-generated)."""
    examples: list[Example] = []
    path = cfg.data.path
    if path is None and cfg.data.seq_kd:
        path = build_seqkd(cfg, accelerator)
    use_topk = cfg.data.use_topk
    if path is not None:
        examples += load_seqkd(path, limit=cfg.data.limit, use_topk=use_topk in ("auto", True))
    if cfg.data.reference:
        prompts = load_prompts(_dataset_cfg(cfg, None), tokenizer, default_split="train")
        examples += reference_examples(prompts[: cfg.data.limit or None], tokenizer)
    if not examples and float(cfg.lmbda) >= 1.0:
        prompts = load_prompts(_dataset_cfg(cfg, None), tokenizer, default_split="train")
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        examples = [Example(prompt_ids=i, completion_ids=[]) for i in ids]
    if not examples:
        raise ConfigError(
            "no training data: set data.path (a Seq-KD dataset), data.seq_kd=true, "
            "data.reference=true or lmbda=1 (on-policy only)"
        )
    topk = has_topk(examples)
    if use_topk is True and not topk:
        raise ConfigError("data.use_topk=true but the training rows carry no stored top-k")
    most_onpolicy = max(float(cfg.lmbda), float(OmegaConf.select(cfg, "switch.lmbda") or 0))
    if topk and most_onpolicy > 0:
        if use_topk is True:
            raise ConfigError(
                f"data.use_topk=true with lmbda={cfg.lmbda}: on-policy batches need the target "
                "loaded; set lmbda=0 or data.use_topk=false"
            )
        examples = [Example(e.prompt_ids, e.completion_ids) for e in examples]
        topk = False
    if topk and float(cfg.loss.temperature) != 1.0:
        raise ConfigError("loss.temperature must be 1 with stored top-k log-probs (stored at T=1)")
    return examples, topk


def eval_topk(cfg: DictConfig, train_examples: list[Example], train_topk: bool) -> int:
    """K of the top-k log-probs stored with the target's held-out continuations (0: none).

    `eval.topk_logprobs: auto` stores the training rows' K when training reads stored top-k
    and the serving mode is one stored log-probs measure exactly (greedy: the stored top-1 is
    argmax p) or as the documented lower bound (T = 1, nothing cut): then the distill stage
    never loads the target. Otherwise 0 (the target is loaded for the held-out figure).
    """
    k = cfg.eval.get("topk_logprobs", "auto")
    if k != "auto":
        if int(k) < 0:
            raise ConfigError(f"eval.topk_logprobs={k} must be >= 0 or auto")
        return int(k)
    s = eval_sampling(cfg)
    stored_ok = s.greedy or (s.temperature == 1.0 and s.top_k == 0 and s.top_p == 1.0)
    if not (train_topk and stored_ok):
        return 0
    return len(train_examples[0].topk_ids[0]) if train_examples[0].topk_ids else 0  # type: ignore[index]


def build_eval_examples(cfg: DictConfig, tokenizer, accelerator, topk: int = 0) -> list[Example]:
    """Held-out rows: reference completions, a given generate run, or (`target`) the target's
    own continuations in the serving mode (greedy, or sampled at eval.sampling), with the
    target's top-`topk` log-probs stored when `topk` > 0 (see `eval_topk`)."""
    if cfg.eval.source == "target":
        settings = {
            "max_new_tokens": int(cfg.eval.max_new_tokens),
            "sampling": eval_sampling(cfg).as_dict(),
            "topk_logprobs": int(topk),
        }
        path = Path(str(cfg.eval.path or Path(str(cfg.output_dir)) / "eval_continuations"))
        run_generate(cfg, accelerator, path, str(cfg.eval.split), settings)
        return load_seqkd(path, limit=cfg.eval.limit, use_topk=topk > 0)
    if cfg.eval.source == "path":
        if cfg.eval.path is None:
            raise ConfigError("eval.source=path needs eval.path (a generate-stage dataset)")
        return load_seqkd(cfg.eval.path, limit=cfg.eval.limit)
    prompts = load_prompts(_dataset_cfg(cfg, cfg.eval.split), tokenizer, default_split="test")
    return reference_examples(prompts[: cfg.eval.limit or None], tokenizer)
