"""What one distill run holds between its steps (`Trainer`), and `prepare`, which builds it: the
pair loaded, the training and held-out rows built, the drafter and its optimizer prepared.

p = target, q = drafter. `prepare` loads the target only when some batch needs its live logits
(training rows or held-out rows without stored top-k, a parallel drafter's held-out depths).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from specdistill.data.models.pairs import load_role, load_tokenizer, resolve_pair
from specdistill.data.sampling import Sampling
from specdistill.distill import parallel
from specdistill.distill.intersection import Intersection
from specdistill.distill.train import fsdp, mapped, packing, rollouts, segment_attention, setup
from specdistill.distill.train.data import (
    Example,
    StreamSpec,
    collate,
    collated_lengths,
    has_topk,
)
from specdistill.distill.train.evaluate import evaluate, evaluate_parallel
from specdistill.distill.train.settings import TrainSettings, lr_schedule


@dataclass
class Trainer:
    """Everything one distill run holds between its named steps (prepare, train_step,
    evaluate_and_save, finish)."""

    cfg: DictConfig  # the config groups that stay nodes (pair, dataset, optim, logger, ...)
    s: TrainSettings  # the stage's own settings, typed and checked
    out: Path
    accelerator: Any
    model: Any  # the prepared drafter q (DDP / DeepSpeed engine)
    target: Any  # the frozen target p, or None when every batch carries stored top-k
    tok: Any
    opt: Any
    sched: Any
    train_examples: Sequence[Example]  # Seq-KD rows read lazily (train/seqkd_rows.py)
    eval_batches: list
    topk: bool
    stream: StreamSpec
    vocab: int
    t_start: float
    mask_token_id: int | None = None  # drafting=parallel (distill.parallel)
    frozen_params: int = 0
    # draft vocabulary trained as decoded (setup.train_head_ids): its ids [K], and the same as
    # an intersection over the K head columns (the loss's treatment of p's mass outside it)
    head_ids: torch.Tensor | None = None
    head_inter: Intersection | None = None
    chunked: bool = False  # the loss from hidden states + head (distill/head_loss.py)
    mapped: mapped.MappedPair | None = None  # a drafter with its own tokenizer (train/mapped.py)
    rollouts: Any = None  # onpolicy.engine=vllm: the drafter in a vLLM engine (train/rollouts.py)
    # pack_sequences: the micro-batch in one row, the models attending span by span
    # (train/segment_attention.py); else rows of max_seq_len under a block mask
    pack_one_row: bool = False

    @property
    def eval_sampling(self) -> Sampling:
        """The serving mode the held-out acceptance is measured in (temperature 0 = greedy)."""
        return self.s.eval.sampling

    @property
    def onpolicy_sampling(self) -> Sampling:
        """How the drafter samples its on-policy batches (temperature 0 = its greedy output)."""
        return self.s.onpolicy.sampling

    @property
    def out_tok(self):
        """The tokenizer saved with best/ and final/: the drafter's own for a mapped pair."""
        return self.tok if self.mapped is None else self.mapped.draft_tok

    @property
    def sharded(self) -> tuple[Any, Any] | None:
        """(model, optimizer) when FSDP2 shards them: their checkpoints are train/fsdp.py's."""
        return (self.model, self.opt) if self.s.fsdp else None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def evaluate(self) -> dict[str, Any]:
        """The held-out figures of the drafter as it is now (what best/ follows)."""
        drafter = self.accelerator.unwrap_model(self.model)
        if self.mapped is not None:
            return self.mapped.evaluate(
                drafter, self.target, self.eval_batches, self.eval_sampling, self.device
            )
        if self.mask_token_id is not None:
            return evaluate_parallel(
                drafter,
                self.target,
                self.eval_batches,
                vocab=self.vocab,
                sampling=self.eval_sampling,
                depth=self.s.parallel.depth,  # type: ignore[union-attr]
                mask_token_id=self.mask_token_id,
                device=self.device,
            )
        return evaluate(
            drafter,
            self.target,
            self.eval_batches,
            vocab=self.vocab,
            sampling=self.eval_sampling,
            device=self.device,
            head_ids=self.head_ids,
        )


def prepare(cfg: DictConfig, s: TrainSettings | None = None) -> Trainer:
    """Check the config, load the pair, build the data, prepare model and optimizer. `s`: the
    settings `run` typed from `cfg` (typed here when not given)."""
    t_start = time.perf_counter()
    s = setup.check_config(cfg, s)
    s.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = setup.make_accelerator(s, cfg)
    device = accelerator.device
    torch.manual_seed(s.seed)

    spec = resolve_pair(cfg.pair, stage="distill", mapped_ok=True)
    cuda = device.type == "cuda"
    # again with the pair's vocab resolved (`auto` may be mapped), before any weights load
    asked = setup.check_sharding(s, spec.vocab == "mapped")
    engine = rollouts.resolve_engine(asked, s.most_onpolicy > 0, cuda)
    if s.fsdp:
        fsdp.ensure_process_group(cuda)
    tok = load_tokenizer(spec)
    drafter = load_role(spec, "drafter", device=device)
    mp = None if spec.vocab != "mapped" else mapped.prepare_mapped(s, spec, tok, drafter, device)
    train_examples, topk = setup.build_train_examples(s, cfg, tok, accelerator, target=spec.target)
    eval_k = setup.eval_topk(s, train_examples, topk)
    eval_examples = setup.build_eval_examples(s, cfg, tok, accelerator, eval_k, target=spec.target)
    eval_has_topk = has_topk(eval_examples)
    mask_id = None
    if s.parallel is not None:
        mask_id = parallel.resolve_train_mask_token(s.parallel.mask_token_id, tok)
        parallel.prepare_drafter(drafter, mask_id, s.parallel.depth)
        eval_has_topk = False  # every depth is evaluated against the target in the loop
    if mp is None:  # rows are in the target's ids: a mapped drafter's draft vocab would be wrong
        setup.set_draft_vocab(s.draft_vocab, drafter, train_examples, tok, mask_id)
    head_ids, head_inter = setup.train_head_ids(s, drafter, topk, mask_id, device)
    target = None
    if not topk or not eval_has_topk:
        if mp is None:
            target = setup.load_target(spec, s, device, drafter, tok)
        else:
            target = mapped.load_mapped_target(spec, s, device, mp)
    pack_one_row = False
    if s.pack_sequences:  # before training: a model that mixes packed sequences is refused
        models = [m for m in (drafter, target) if m is not None]
        if all(segment_attention.supports(m) for m in models):  # span by span, one row
            for m in models:
                segment_attention.use_segments(m)
            pack_one_row = True
        packing.check_isolation(drafter, "drafter", str(spec.drafter), len(tok))
        if target is not None:
            packing.check_isolation(target, "target", str(spec.target), len(tok))
    vllm_rollouts = None
    if engine == "vllm":
        context = min(int(getattr(drafter.config, "max_position_embeddings", 8192)), 8192)
        dtype = "bfloat16" if cuda else "float32"
        vllm_rollouts = rollouts.VLLMRollouts.build(
            spec, dtype, context, s.micro_batch_size, s.seed, accelerator.num_processes
        )
    model, opt, sched, frozen = _prepare_training(s, cfg, drafter, accelerator)
    return Trainer(
        cfg=cfg,
        s=s,
        out=s.output_dir,
        accelerator=accelerator,
        model=model,
        target=target,
        tok=tok,
        opt=opt,
        sched=sched,
        train_examples=train_examples,
        eval_batches=_eval_batches(s, eval_examples, tok.pad_token_id),
        topk=topk,
        stream=StreamSpec(
            len(train_examples),
            s.micro_batch_size,
            accelerator.num_processes,
            s.grad_accum,
            s.seed,
            s.group_by_length,
            # a tuple of Python ints per row: built only when grouping reads it
            collated_lengths(train_examples, s.max_seq_len) if s.group_by_length else None,
        ),
        # both models' logits are cut to the real tokens (padding rows dropped)
        vocab=len(tok),
        t_start=t_start,
        mask_token_id=mask_id,
        frozen_params=frozen,
        head_ids=head_ids,
        head_inter=head_inter,
        chunked=s.use_chunked_loss(len(tok)),
        mapped=mp,
        rollouts=vllm_rollouts,
        pack_one_row=pack_one_row,
    )


def _eval_batches(s: TrainSettings, examples: Sequence[Example], pad_id: int) -> list[dict]:
    """The held-out rows collated once, `eval.batch_size` at a time."""
    size = s.eval.batch_size
    return [
        collate(examples[i : i + size], pad_id, s.max_seq_len)
        for i in range(0, len(examples), size)
    ]


def _prepare_training(
    s: TrainSettings, cfg: DictConfig, drafter, accelerator
) -> tuple[Any, Any, Any, int]:
    """(model, optimizer, LR scheduler, frozen parameter count): the drafter in training mode
    with its embeddings frozen where set, the optimizer over what still trains, both prepared
    by accelerate, and the tracker started."""
    drafter.train()
    if s.gradient_checkpointing:
        setup.checkpoint_layers(drafter)
    frozen = setup.freeze_embeddings(s, cfg.pair, drafter)
    if s.fsdp:  # sharded in place before the optimizer sees its parameters (train/fsdp.py)
        fsdp.shard_model(drafter, accelerator.mixed_precision, accelerator.device)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = hydra.utils.instantiate(cfg.optim.optimizer)(trainable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg.optim, s.max_steps))
    # The scheduler is not prepared: accelerate would step it once per process per step (for
    # split data), so 2 processes would decay the LR twice as fast as 1 with 2x accumulation.
    # A sharded model and its optimizer are not prepared either: accelerate would wrap DDP
    # around them; their checkpoints are train/fsdp.py's.
    model = drafter
    if not s.fsdp:
        model, opt = accelerator.prepare(drafter, opt)
    accelerator.register_for_checkpointing(sched)
    setup.init_logger(accelerator, cfg)
    return model, opt, sched, frozen
