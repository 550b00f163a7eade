"""Distill-stage set-up: the machine's checks, the accelerator, models and data sources.

The stage's settings are typed and checked by `TrainSettings.from_cfg` (train/settings.py);
what depends on this machine is checked here (`check_config`), and the data sources raise a
ConfigError naming the field for what only the files can tell (no rows, no stored top-k), all
before any model trains.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
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
from specdistill.data.prompts import check_prompt_settings, load_prompts
from specdistill.data.runtime import ConfigError, parse_dtype
from specdistill.decode.draft_vocab import (
    CONFIG_KEY,
    draft_vocab_size,
    drafter_vocab_ids,
)
from specdistill.distill.intersection import Intersection
from specdistill.distill.train import fsdp, mask_row, rollouts, zero
from specdistill.distill.train.data import Example, load_seqkd, reference_examples
from specdistill.distill.train.seqkd_rows import (
    chain,
    has_topk,
    token_arrays,
    topk_width,
    without_topk,
)
from specdistill.distill.train.settings import TrainSettings

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


def train_head_ids(
    s: TrainSettings, drafter, topk: bool, mask_id: int | None, device
) -> tuple[torch.Tensor | None, Intersection | None]:
    """(ids [K], the draft vocabulary as an `Intersection` over K head columns) when the drafter
    trains on its draft vocabulary (`draft_vocab_train=true`): the loss then sees q over the
    subset, the distribution our decoder drafts from, and the head's matmul and gradient shrink
    by V / K.

    A draft vocabulary is a vocabulary intersection (column j proposes target id ids[j]), so the
    loss is intersection.py's treatment (b): the target's stored top-k mass outside the subset
    goes to an outcome q cannot produce, not into the top-k loss's rest bucket, where q would be
    asked to match it with mass on in-vocabulary tokens off the top-k; TVD then reads as 1 - the
    acceptance our decoder serves (exactly when the top-k tail is empty), and greedy serving
    drops positions whose stored top-1 is outside (`tli_mask_unreachable`).

    `auto` (the default) turns it on for big heads only (`TrainSettings.trains_draft_vocab`):
    logits outside the subset are never trained down, so the export pads the head for engines
    that run all of it (export/head.py). Only stored top-k rows of an autoregressive drafter use
    it; other paths keep the full head."""
    ids = getattr(drafter.config, CONFIG_KEY, None)
    rows = drafter.get_output_embeddings().weight.shape[0]
    if not s.trains_draft_vocab(rows) or not ids or not topk or mask_id is not None:
        return None, None
    head_ids = torch.tensor(ids, dtype=torch.long)
    inter = Intersection.from_draft_to_target(head_ids, rows)
    return head_ids.to(device), inter.to(device)


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


def freeze_embeddings(s: TrainSettings, pair: Any, model) -> int:
    """Freeze the drafter's input embeddings and LM head (`freeze_embeddings`); the number of
    parameters frozen.

    A drafter built from the target's layers starts with the target's own embeddings and head;
    the layers are what has to learn. With a vocabulary of 49k and hidden 576 the (tied) head
    is 28M of SmolLM2 first:4's 42.5M parameters, so training it costs a [V, H] weight gradient
    per micro-batch and 2 x 28M AdamW moments per step for little gain. `auto`: on exactly
    when `pair.drafter_layers` builds the drafter. A parallel drafter's mask token has no
    trained row, so there every row but the mask token's stays frozen and the head is untied
    (`train/mask_row.py`).
    """
    mode = s.freeze_embeddings
    if mode == "auto":
        mode = OmegaConf.select(pair, "drafter_layers") is not None
    if not mode:
        return 0
    if s.drafting == "parallel":  # the mask token's row learns, alone (train/mask_row.py)
        return mask_row.train_mask_row_only(model, int(model.config.mask_token_id))
    frozen: dict[int, torch.nn.Parameter] = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is None:
            continue
        for param in module.parameters():
            param.requires_grad_(False)
            frozen[id(param)] = param  # a tied head is the embedding's tensor: counted once
    return sum(p.numel() for p in frozen.values())


def use_cuda(s: TrainSettings) -> bool:
    return torch.cuda.is_available() and s.device != "cpu"


def make_accelerator(s: TrainSettings, cfg: DictConfig):
    """accelerate handles devices and processes; our own loop does the accumulation (so the
    loss can be normalised by the window's tokens), except under DeepSpeed, whose engine must
    own the accumulation boundary (see `zero`)."""
    from accelerate import Accelerator

    mp = s.mixed_precision
    if mp == "auto":
        mp = "bf16" if use_cuda(s) else "no"
    kwargs: dict[str, Any] = {"mixed_precision": mp, "cpu": not use_cuda(s)}
    if cfg.logger.name == "wandb":
        kwargs["log_with"] = "wandb"
        kwargs["project_dir"] = str(s.output_dir)
    if s.deepspeed:
        return zero.make_deepspeed_accelerator(cfg, use_cuda(s), kwargs)
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


def _dataset_cfg(cfg: DictConfig, split: str | None) -> DictConfig:
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if split is not None:
        ds["split"] = split
    return OmegaConf.create(ds)


def build_seqkd(s: TrainSettings, cfg: DictConfig, accelerator) -> Path:
    """Run the generate stage into output_dir/seqkd (main process; reused when complete)."""
    return run_generate(s, cfg, accelerator, s.output_dir / "seqkd", "train", s.data.generate)


def run_generate(
    s: TrainSettings, cfg: DictConfig, accelerator, path: Path, split: str, settings: dict
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

        overrides = [f"output_dir={path}", f"split={split}", f"seed={s.seed}"]
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
        # the eval rows come from eval.split even where the set names one split for every stage
        # (data/splits.py; the plan's held-out check reads them the same way)
        gcfg.dataset = _dataset_cfg(cfg, None if split == "train" else split)
        if split != "train":
            gcfg.dataset.limit = s.eval.limit
        gcfg.shard = {"index": 0, "count": 1}
        gcfg.progress = False
        if s.device == "cpu":
            gcfg.device = "cpu"
        log.info("target continuations (%s split) with the generate stage -> %s", split, path)
        generate(gcfg)
    accelerator.wait_for_everyone()
    return path


def build_train_examples(
    s: TrainSettings, cfg: DictConfig, tokenizer, accelerator, *, target: str | None = None
) -> tuple[Sequence[Example], bool]:
    """(examples, top-k mode). Sources mix: Seq-KD rows (read lazily) + reference completions;
    with lmbda = 1 and neither, the dataset's prompts alone (every batch is drafter-generated).
    `target`: the resolved target path (`source: self` samples its queries from it)."""
    parts: list[Sequence[Example]] = []
    data = s.data
    paths = list(data.paths)
    if not paths and data.seq_kd:
        paths = [build_seqkd(s, cfg, accelerator)]
    use_topk = data.use_topk
    for path in paths:  # several: one Seq-KD set per chat mode, each capped at data.limit
        parts.append(load_seqkd(path, limit=data.limit, use_topk=use_topk in ("auto", True)))
    if data.reference:
        prompts = load_prompts(
            _dataset_cfg(cfg, None), tokenizer, default_split="train", target=target
        )
        parts.append(reference_examples(prompts[: data.limit or None], tokenizer))
    examples = chain(parts)
    if not examples and s.lmbda >= 1.0:
        prompts = load_prompts(
            _dataset_cfg(cfg, None), tokenizer, default_split="train", target=target
        )
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
    if topk and s.most_onpolicy > 0:
        if use_topk is True:
            raise ConfigError(
                f"data.use_topk=true with lmbda={cfg.lmbda}: on-policy batches need the target "
                "loaded; set lmbda=0 or data.use_topk=false"
            )
        examples = without_topk(examples)
        topk = False
    if topk and s.loss.temperature != 1.0:
        raise ConfigError("loss.temperature must be 1 with stored top-k log-probs (stored at T=1)")
    return examples, topk


def eval_topk(s: TrainSettings, train_examples: Sequence[Example], train_topk: bool) -> int:
    """K of the top-k log-probs stored with the target's held-out continuations (0: none).

    `eval.topk_logprobs: auto` stores the training rows' K when training reads stored top-k
    and the serving mode is one stored log-probs measure exactly (greedy: the stored top-1 is
    argmax p) or as the documented lower bound (T = 1, nothing cut): then the distill stage
    never loads the target. Otherwise 0 (the target is loaded for the held-out figure).
    """
    k = s.eval.topk_logprobs
    if k != "auto":
        return int(k)
    sp = s.eval.sampling
    stored_ok = sp.greedy or (sp.temperature == 1.0 and sp.top_k == 0 and sp.top_p == 1.0)
    if not (train_topk and stored_ok):
        return 0
    return topk_width(train_examples)


def build_eval_examples(
    s: TrainSettings,
    cfg: DictConfig,
    tokenizer,
    accelerator,
    topk: int = 0,
    *,
    target: str | None = None,
) -> list[Example]:
    """Held-out rows: reference completions, a given generate run, or (`target`) the target's
    own continuations in the serving mode (greedy, or sampled at eval.sampling), with the
    target's top-`topk` log-probs stored when `topk` > 0 (see `eval_topk`)."""
    ev = s.eval
    if ev.source == "target":
        settings = {
            "max_new_tokens": ev.max_new_tokens,
            "sampling": ev.sampling.as_dict(),
            "topk_logprobs": int(topk),
        }
        path = Path(str(ev.path or s.output_dir / "eval_continuations"))
        run_generate(s, cfg, accelerator, path, str(ev.split), settings)
        return load_seqkd(path, limit=ev.limit, use_topk=topk > 0)
    if ev.source == "path":
        if ev.path is None:
            raise ConfigError("eval.source=path needs eval.path (a generate-stage dataset)")
        return load_seqkd(ev.path, limit=ev.limit)
    prompts = load_prompts(
        _dataset_cfg(cfg, ev.split), tokenizer, default_split="test", target=target
    )
    return reference_examples(prompts[: ev.limit or None], tokenizer)
