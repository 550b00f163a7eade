"""What one distill run holds between its steps (`Trainer`), and `prepare`, which builds it: the
run's two parts chosen (train/parts.py), the pair loaded, the training and held-out rows built,
the drafter and its optimizer prepared.

p = target, q = drafter. `prepare` loads the target only when the objective needs its live
logits (training rows or held-out rows without stored top-k, a parallel drafter's depths).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import torch
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LRScheduler

from specdistill.data.models.pairs import PairSpec, load_role, load_tokenizer, resolve_pair
from specdistill.data.sampling import Sampling
from specdistill.distill.intersection import Intersection
from specdistill.distill.train import packing, rollouts, segment_attention, setup, sources
from specdistill.distill.train.data import Example, StreamSpec, collate, collated_lengths
from specdistill.distill.train.lr_schedule import lr_schedule
from specdistill.distill.train.objective import Objective
from specdistill.distill.train.parts import Parts, choose_parts
from specdistill.distill.train.rollouts import VLLMRollouts
from specdistill.distill.train.seqkd_rows import has_topk
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.spread import Spread

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Trainer:
    """Everything one distill run holds between its named steps (prepare, train_step,
    evaluate_and_save, finish)."""

    cfg: DictConfig  # the config groups that stay nodes (pair, dataset, optim, logger, ...)
    s: TrainSettings  # the stage's own settings, typed and checked
    out: Path
    accelerator: Accelerator
    model: torch.nn.Module  # the drafter q as the spread prepared it (DDP / DeepSpeed / FSDP2)
    target: PreTrainedModel | None  # the frozen target p; None when every batch has stored top-k
    tok: PreTrainedTokenizerBase
    opt: torch.optim.Optimizer
    sched: LRScheduler
    objective: Objective  # what q is trained against (train/objective.py)
    spread: Spread  # how q is spread over processes (train/spread.py)
    train_examples: Sequence[Example]  # Seq-KD rows read lazily (train/seqkd_rows.py)
    eval_batches: list[dict[str, torch.Tensor]]
    topk: bool
    stream: StreamSpec
    vocab: int
    t_start: float
    frozen_params: int = 0
    # draft vocabulary trained as decoded (shared_vocab.train_head_ids): its ids [K], and the
    # same as an intersection over the K head columns (the loss's treatment of p's mass outside)
    head_ids: torch.Tensor | None = None
    head_inter: Intersection | None = None
    chunked: bool = False  # the loss from hidden states + head (distill/head_loss.py)
    rollouts: VLLMRollouts | None = None  # onpolicy.engine=vllm (train/rollouts.py)
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
    def out_tok(self) -> PreTrainedTokenizerBase:
        """The tokenizer saved with best/ and final/ (a mapped drafter's own)."""
        return self.objective.out_tok(self.tok)

    @property
    def sharded(self) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        """(model, optimizer) when the spread writes their checkpoints itself (FSDP2)."""
        return self.spread.sharded(self.model, self.opt)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def evaluate(self) -> dict[str, Any]:
        """The held-out figures of the drafter as it is now (what best/ follows)."""
        return self.objective.evaluate(self)


@dataclass
class _Loaded:
    """What `prepare` loads before the optimizer: tokenizer, models and rows."""

    tok: PreTrainedTokenizerBase
    drafter: PreTrainedModel
    target: PreTrainedModel | None
    train_examples: Sequence[Example]
    topk: bool
    eval_examples: Sequence[Example]
    head_ids: torch.Tensor | None
    head_inter: Intersection | None
    pack_one_row: bool


def prepare(cfg: DictConfig, s: TrainSettings | None = None) -> Trainer:
    """Check the config, choose the run's parts, load the pair, build the data, prepare model
    and optimizer. `s`: the settings `run` typed from `cfg` (typed here when not given)."""
    t_start = time.perf_counter()
    s = setup.check_config(cfg, s)
    s.output_dir.mkdir(parents=True, exist_ok=True)
    spec = resolve_pair(cfg.pair, stage="distill", mapped_ok=True)
    # again with the pair's vocab resolved (`auto` may be mapped), before any weights load
    asked = setup.check_sharding(s, spec.vocab == "mapped")
    parts = choose_parts(s, spec.vocab)
    accelerator = parts.spread.make_accelerator(
        cfg, setup.use_cuda(s), setup.accelerator_kwargs(s, cfg)
    )
    torch.manual_seed(s.seed)
    cuda = accelerator.device.type == "cuda"
    engine = rollouts.resolve_engine(asked, s.most_onpolicy > 0, cuda)
    parts.spread.before_load(cuda)
    got = _load(s, cfg, spec, parts.objective, accelerator)
    vllm_rollouts = None
    if engine == "vllm":
        vllm_rollouts = _vllm_rollouts(s, spec, got.drafter, accelerator, cuda)
    model, opt, sched, frozen = _prepare_training(s, cfg, got.drafter, accelerator, parts)
    return Trainer(
        cfg=cfg, s=s, out=s.output_dir, accelerator=accelerator, model=model, target=got.target,
        tok=got.tok, opt=opt, sched=sched, objective=parts.objective, spread=parts.spread,
        train_examples=got.train_examples,
        eval_batches=_eval_batches(s, got.eval_examples, got.tok.pad_token_id),
        topk=got.topk, stream=_stream(s, got.train_examples, accelerator.num_processes),
        vocab=len(got.tok),  # both models' logits are cut to the real tokens (padding rows dropped)
        t_start=t_start, frozen_params=frozen, head_ids=got.head_ids, head_inter=got.head_inter,
        chunked=s.use_chunked_loss(len(got.tok)), rollouts=vllm_rollouts,
        pack_one_row=got.pack_one_row,
    )  # fmt: skip


def _load(
    s: TrainSettings, cfg: DictConfig, spec: PairSpec, objective: Objective,
    accelerator: Accelerator,
) -> _Loaded:  # fmt: skip
    """The tokenizer and drafter, the objective's set-up, the rows, the draft vocabulary and the
    target where the objective needs it; packed sequences checked on both models."""
    device = accelerator.device
    tok = load_tokenizer(spec)
    drafter = load_role(spec, "drafter", device=device)
    objective.prepare_drafter(spec, tok, drafter, device)
    train_examples, topk = sources.build_train_examples(
        s, cfg, tok, accelerator, target=spec.target
    )
    eval_k = sources.eval_topk(s, train_examples, topk)
    eval_examples = sources.build_eval_examples(
        s, cfg, tok, accelerator, eval_k, target=spec.target
    )
    objective.store_draft_vocab(drafter, train_examples, tok)
    head_ids, head_inter = objective.train_head(drafter, topk, device)
    target = None
    if objective.needs_target(topk, has_topk(eval_examples)):
        target = objective.load_target(spec, device, drafter, tok)
    pack_one_row = s.pack_sequences and _use_packing(spec, drafter, target, len(tok))
    return _Loaded(
        tok, drafter, target, train_examples, topk, eval_examples, head_ids, head_inter,
        pack_one_row,
    )  # fmt: skip


def _use_packing(
    spec: PairSpec, drafter: PreTrainedModel, target: PreTrainedModel | None, vocab: int
) -> bool:
    """`pack_sequences`, before training: a model that mixes packed sequences is refused; True
    when both models attend span by span (the micro-batch in one row)."""
    models = [m for m in (drafter, target) if m is not None]
    one_row = all(segment_attention.supports(m) for m in models)
    if one_row:
        for m in models:
            segment_attention.use_segments(m)
    packing.check_isolation(drafter, "drafter", str(spec.drafter), vocab)
    if target is not None:
        packing.check_isolation(target, "target", str(spec.target), vocab)
    return one_row


def _vllm_rollouts(
    s: TrainSettings, spec: PairSpec, drafter: PreTrainedModel, accelerator: Accelerator,
    cuda: bool,
) -> VLLMRollouts:  # fmt: skip
    """The drafter in a vLLM engine for on-policy batches (train/rollouts.py)."""
    context = min(int(getattr(drafter.config, "max_position_embeddings", 8192)), 8192)
    dtype = "bfloat16" if cuda else "float32"
    return VLLMRollouts.build(
        spec, dtype, context, s.micro_batch_size, s.seed, accelerator.num_processes
    )


def _stream(s: TrainSettings, examples: Sequence[Example], world: int) -> StreamSpec:
    """Which rows form which micro-batch (train/data.py)."""
    return StreamSpec(
        len(examples), s.micro_batch_size, world, s.grad_accum, s.seed, s.group_by_length,
        # a tuple of Python ints per row: built only when grouping reads it
        collated_lengths(examples, s.max_seq_len) if s.group_by_length else None,
    )  # fmt: skip


def _eval_batches(
    s: TrainSettings, examples: Sequence[Example], pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """The held-out rows collated once, `eval.batch_size` at a time."""
    size = s.eval.batch_size
    return [
        collate(examples[i : i + size], pad_id, s.max_seq_len)  # type: ignore[arg-type]
        for i in range(0, len(examples), size)
    ]


def _prepare_training(
    s: TrainSettings, cfg: DictConfig, drafter: PreTrainedModel, accelerator: Accelerator,
    parts: Parts,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, LRScheduler, int]:  # fmt: skip
    """(model, optimizer, LR scheduler, frozen parameter count): the drafter in training mode
    with its embeddings frozen where set, spread before the optimizer sees its parameters, the
    optimizer over what still trains, both wrapped as the spread steps them, the tracker
    started."""
    drafter.train()
    if s.gradient_checkpointing:
        setup.checkpoint_layers(drafter)
    frozen = setup.freeze_embeddings(s, cfg.pair, drafter, parts.objective)
    parts.spread.shard(drafter, accelerator)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = hydra.utils.instantiate(cfg.optim.optimizer)(trainable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg.optim, s.max_steps))
    # The scheduler is not prepared: accelerate would step it once per process per step (for
    # split data), so 2 processes would decay the LR twice as fast as 1 with 2x accumulation.
    model, opt = parts.spread.wrap(drafter, opt, accelerator)
    accelerator.register_for_checkpointing(sched)
    setup.init_logger(accelerator, cfg)
    return model, opt, sched, frozen
