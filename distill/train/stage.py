"""The distill stage: train the drafter q towards the frozen target p (DistillSpec / GKD).

    python -m specdistill.distill.train pair=toy-tiny output_dir=DIR max_steps=50
    torchrun --nproc_per_node 2 -m specdistill.distill.train ... [deepspeed=zero2|zero3]

Data sources mix (Seq-KD rows, reference completions, on-policy drafter samples with
probability `lmbda` per micro-batch); the target runs on the fly (frozen, no grad) unless the
Seq-KD rows carry stored top-k log-probs. The loss is summed over completion tokens and divided
by the token count of the whole accumulation window across processes, so 2 processes x 1
micro-batch train exactly like 1 process x 2. Writes `output_dir/result.json`, `best/` (the
best held-out alpha: the drafter to ship), `final/` and resumable `checkpoints/`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdistill.data.io import atomic_write_json
from specdistill.data.models.pairs import load_role, load_tokenizer, resolve_pair
from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.distill import parallel
from specdistill.distill.head_loss import HeadInput, fused_distill_loss
from specdistill.distill.losses import distill_loss, subset_topk
from specdistill.distill.train import checkpoint as ckpt
from specdistill.distill.train import mapped, setup, zero
from specdistill.distill.train.data import (
    StreamSpec,
    collate,
    is_onpolicy,
    micro_seed,
    sample_onpolicy,
)
from specdistill.distill.train.evaluate import evaluate, evaluate_parallel
from specdistill.distill.train.logits import has_plain_head, masked_head_input, masked_logits
from specdistill.distill.train.predict import heldout_prediction
from specdistill.distill.train.sweep_summary import write_summary

log = logging.getLogger("specdistill.distill")

# Test hook: called as STEP_HOOK(step) after every optimizer step (and its checkpoint), e.g. to
# simulate a crash at a chosen step.
STEP_HOOK: Callable[[int], None] | None = None


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


def _schedule(cfg: DictConfig) -> Callable[[int], float]:
    """LR multiplier: linear warmup, then cosine/linear decay to min_lr_ratio (or constant)."""
    warm, total = int(cfg.optim.warmup_steps), int(cfg.max_steps)
    floor, kind = float(cfg.optim.min_lr_ratio), cfg.optim.schedule

    def mult(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1 - frac
        return floor + (1 - floor) * shape

    return mult


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


@dataclass
class Trainer:
    """Everything one distill run holds between its named steps (prepare, train_step,
    evaluate_and_save, finish)."""

    cfg: DictConfig
    out: Path
    accelerator: Any
    model: Any  # the prepared drafter q (DDP / DeepSpeed engine)
    target: Any  # the frozen target p, or None when every batch carries stored top-k
    tok: Any
    opt: Any
    sched: Any
    train_examples: list
    eval_batches: list
    eval_sampling: Any
    onpolicy_sampling: Any
    topk: bool
    stream: StreamSpec
    vocab: int
    t_start: float
    mask_token_id: int | None = None  # drafting=parallel (distill.parallel)
    frozen_params: int = 0
    # draft vocabulary trained as decoded (setup.train_head_ids): its ids [K], token -> column
    head_ids: torch.Tensor | None = None
    head_index: torch.Tensor | None = None
    chunked: bool = False  # the loss from hidden states + head (distill/head_loss.py)
    mapped: mapped.MappedPair | None = None  # a drafter with its own tokenizer (train/mapped.py)

    @property
    def out_tok(self):
        """The tokenizer saved with best/ and final/: the drafter's own for a mapped pair."""
        return self.tok if self.mapped is None else self.mapped.draft_tok

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def evaluate(self) -> dict[str, Any]:
        if self.mapped is not None:
            drafter = self.accelerator.unwrap_model(self.model)
            return self.mapped.evaluate(
                drafter, self.target, self.eval_batches, self.eval_sampling, self.device
            )
        if self.mask_token_id is not None:
            return evaluate_parallel(
                self.accelerator.unwrap_model(self.model),
                self.target,
                self.eval_batches,
                vocab=self.vocab,
                sampling=self.eval_sampling,
                depth=int(self.cfg.parallel.depth),
                mask_token_id=self.mask_token_id,
                device=self.device,
            )
        return evaluate(
            self.accelerator.unwrap_model(self.model),
            self.target,
            self.eval_batches,
            vocab=self.vocab,
            sampling=self.eval_sampling,
            device=self.device,
            head_ids=self.head_ids,
        )


def prepare(cfg: DictConfig) -> Trainer:
    """Check the config, load the pair, build the data, prepare model and optimizer."""
    t_start = time.perf_counter()
    setup.check_config(cfg)
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    accelerator = setup.make_accelerator(cfg)
    device, world = accelerator.device, accelerator.num_processes
    torch.manual_seed(int(cfg.seed))

    spec = resolve_pair(cfg.pair, stage="distill", mapped_ok=True)
    tok = load_tokenizer(spec)
    drafter = load_role(spec, "drafter", device=device)
    mp = None if spec.vocab != "mapped" else mapped.prepare_mapped(cfg, spec, tok, drafter, device)
    train_examples, topk = setup.build_train_examples(cfg, tok, accelerator)
    eval_k = setup.eval_topk(cfg, train_examples, topk)
    eval_examples = setup.build_eval_examples(cfg, tok, accelerator, eval_k)
    eval_has_topk = all(e.topk_ids is not None for e in eval_examples)
    mask_id = None
    if cfg.drafting == "parallel":
        mask_id = parallel.resolve_train_mask_token(cfg.parallel.mask_token_id, tok)
        parallel.prepare_drafter(drafter, mask_id, int(cfg.parallel.depth))
        eval_has_topk = False  # every depth is evaluated against the target in the loop
    if mp is None:  # rows are in the target's ids: a mapped drafter's draft vocab would be wrong
        setup.set_draft_vocab(cfg, drafter, train_examples, tok, mask_id)
    head_ids, head_index = setup.train_head_ids(cfg, drafter, topk, mask_id, device)
    target = None
    if not topk or not eval_has_topk:
        if mp is None:
            target = setup.load_target(spec, cfg, device, drafter, tok)
        else:
            target = mapped.load_mapped_target(spec, cfg, device, mp)
    eval_batches = [
        collate(
            eval_examples[i : i + int(cfg.eval.batch_size)], tok.pad_token_id, int(cfg.max_seq_len)
        )
        for i in range(0, len(eval_examples), int(cfg.eval.batch_size))
    ]

    drafter.train()
    frozen = setup.freeze_embeddings(cfg, drafter)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = hydra.utils.instantiate(cfg.optim.optimizer)(trainable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
    # The scheduler is not prepared: accelerate would step it once per process per step (for
    # split data), so 2 processes would decay the LR twice as fast as 1 with 2x accumulation.
    model, opt = accelerator.prepare(drafter, opt)
    accelerator.register_for_checkpointing(sched)
    setup.init_logger(accelerator, cfg)
    stream = StreamSpec(
        len(train_examples), int(cfg.micro_batch_size), world, int(cfg.grad_accum), int(cfg.seed)
    )
    return Trainer(
        cfg=cfg,
        out=out,
        accelerator=accelerator,
        model=model,
        target=target,
        tok=tok,
        opt=opt,
        sched=sched,
        train_examples=train_examples,
        eval_batches=eval_batches,
        eval_sampling=setup.eval_sampling(cfg),
        onpolicy_sampling=setup.onpolicy_sampling(cfg),
        topk=topk,
        stream=stream,
        # both models' logits are cut to the real tokens (padding rows dropped)
        vocab=len(tok),
        t_start=t_start,
        mask_token_id=mask_id,
        frozen_params=frozen,
        head_ids=head_ids,
        head_index=head_index,
        chunked=setup.chunked_loss(cfg, len(tok)),
        mapped=mp,
    )


def start_or_resume(tr: Trainer) -> dict[str, Any]:
    """The run's state: restored from the latest checkpoint, or fresh (evaluated at step 0)."""
    cfg, accelerator = tr.cfg, tr.accelerator
    root = tr.out / "checkpoints"
    latest = ckpt.latest_checkpoint(root) if cfg.resume else None
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
    if cfg.resume:
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


def micro_batches(tr: Trainer, step: int, lmbda: float) -> list[tuple[dict, bool]]:
    """This process's micro-batches of one optimizer step, each flagged on-policy or not."""
    cfg, seed = tr.cfg, int(tr.cfg.seed)
    zero3 = zero.zero_stage(cfg) == 3
    rank = tr.accelerator.process_index
    window = []
    for a in range(int(cfg.grad_accum)):
        g = tr.stream.global_micro_index(step, a, rank)
        exs = [tr.train_examples[i] for i in tr.stream.indices(g)]
        onp = is_onpolicy(seed, g, lmbda)
        # ZeRO-3: a forward gathers shards from every rank, so when any rank of this slot
        # is on-policy all of them generate together (and the others drop their samples).
        if onp or (zero3 and zero.any_rank_onpolicy(tr.stream, step, a, seed, lmbda)):
            sampled = sample_onpolicy(
                tr.accelerator.unwrap_model(tr.model),
                exs,
                pad_id=tr.tok.pad_token_id,
                eos_id=tr.tok.eos_token_id,
                max_new_tokens=int(cfg.onpolicy.max_new_tokens),
                sampling=tr.onpolicy_sampling,
                seed=micro_seed(seed, g),
                synced_gpus=zero3,
            )
            exs = sampled if onp else exs
        batch = collate(exs, tr.tok.pad_token_id, int(cfg.max_seq_len))
        if tr.mask_token_id is not None:  # mask chains appended, anchors drawn per micro-batch
            batch["packed"] = parallel.pack_batch(batch, cfg.parallel, tr.mask_token_id, seed, g)
        window.append((batch, onp))
    return window


def _logits_and_targets(
    tr: Trainer, batch: dict[str, torch.Tensor], onp: bool, masked: bool
) -> tuple[torch.Tensor | HeadInput, torch.Tensor, dict[str, Any]]:
    """(drafter logits, loss mask, the target's keywords for `distill_loss`) of one micro-batch.

    `masked`: logits of the loss positions only, as one [1, N, V] row (`logits.masked_logits`),
    and the target's logits or stored top-k gathered at the same positions; else the padded
    [b, n, V] grid. The loss is a sum over positions, so both give the same value. With
    `tr.chunked` (and a plain head) the drafter comes as hidden states + head (`HeadInput`,
    for `fused_distill_loss`), and so does a live target with a plain head.
    """
    ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    use_topk = tr.topk and not onp
    sub = masked and use_topk and tr.head_ids is not None  # the draft vocabulary's head only
    fused = masked and not sub and tr.chunked and has_plain_head(tr.model)
    with tr.accelerator.autocast():
        if fused:
            logits = masked_head_input(tr.model, ids, att, mask, tr.vocab)
        elif masked:
            head = tr.head_ids if sub else None
            logits = masked_logits(tr.model, ids, att, mask, tr.vocab, head)[None]
        else:
            logits = tr.model(input_ids=ids, attention_mask=att).logits[..., : tr.vocab]
    if use_topk:
        kwargs: dict[str, Any] = {"topk_ids": batch["topk_ids"], "topk_lp": batch["topk_lp"]}
        if masked:
            kwargs = {k: v[mask][None] for k, v in kwargs.items()}
        if sub:
            logits, kwargs["topk_ids"], kwargs["topk_lp"] = subset_topk(
                logits, kwargs["topk_ids"], kwargs["topk_lp"], tr.head_index
            )
    else:
        with torch.no_grad():
            if fused and has_plain_head(tr.target):
                target = masked_head_input(tr.target, ids, att, mask, tr.vocab)
            elif masked:
                target = masked_logits(tr.target, ids, att, mask, tr.vocab)[None]
            else:
                target = tr.target(input_ids=ids, attention_mask=att).logits[..., : tr.vocab]
        kwargs = {"target_logits": target}
    if masked:
        rows = logits.hidden.shape[:1] if fused else logits.shape[:2]  # type: ignore[union-attr]
        mask = torch.ones(rows, dtype=torch.bool, device=ids.device)
    return logits, mask, kwargs


def _packed_logits_and_targets(
    tr: Trainer, batch: dict[str, torch.Tensor], packed: dict[str, torch.Tensor], onp: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """drafting=parallel: the drafter's logits over the packed sequence (real tokens + mask
    chains), the target's figures gathered at each packed position's label, depth weights."""
    with tr.accelerator.autocast():
        logits = parallel.packed_forward(tr.model, packed)[..., : tr.vocab]
    if tr.topk and not onp:
        kwargs: dict[str, Any] = {"topk_ids": batch["topk_ids"], "topk_lp": batch["topk_lp"]}
    else:
        with torch.no_grad():
            kwargs = {
                "target_logits": tr.target(  # type: ignore[misc]
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits[..., : tr.vocab]
            }
    kwargs = {k: parallel.gather_positions(v, packed["label_pos"]) for k, v in kwargs.items()}
    kwargs["weights"] = packed["weight"]
    objective = str(tr.cfg.parallel.get("objective", "token"))
    if objective != "token":  # weights (and -E) from the drafter's own soft acceptance
        s = tr.eval_sampling  # the serving mode: greedy target or sampling at its temperature
        accept = parallel.packed_acceptance(logits, kwargs, s.greedy, float(s.temperature or 1))
        kwargs["weights"] = parallel.objective_weights(accept.detach(), packed)
        if objective == "acceptance_length":
            kwargs["length_sum"] = parallel.chains_expected_length(accept, packed)
    return logits, packed["weight"] > 0, kwargs


def _shared_vocab_loss(
    tr: Trainer, batch: dict, packed: dict | None, onp: bool, masked: bool, loss_name: str,
    beta: float, num_tokens: float, n_chains: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """One micro-batch's share of the window's loss when the drafter reads the target's ids
    (a parallel drafter with `parallel.objective=acceptance_length` also maximises the expected
    accepted length per mask chain of the window)."""
    if packed is None:
        logits, mask, kwargs = _logits_and_targets(tr, batch, onp, masked)
    else:
        logits, mask, kwargs = _packed_logits_and_targets(tr, batch, packed, onp)
    length_sum = kwargs.pop("length_sum", None)  # parallel.objective=acceptance_length
    fused = isinstance(logits, HeadInput)
    loss = (fused_distill_loss if fused else distill_loss)(
        logits,  # type: ignore[arg-type]
        mask,
        divergence=loss_name,
        beta=beta,
        temperature=float(tr.cfg.loss.temperature),
        num_tokens=num_tokens,
        chunk_size=None if fused else tr.cfg.loss_chunk_size,
        **kwargs,
    )
    if length_sum is not None:  # maximise E[accepted] per chain of the window
        w_len = float(tr.cfg.parallel.get("length_weight", 1.0))
        loss = loss - w_len * length_sum / max(n_chains, 1)
    return loss


def train_step(tr: Trainer, step: int) -> dict[str, Any]:
    """One optimizer step over the accumulation window; its log record (without eval)."""
    cfg, accelerator, model, device = tr.cfg, tr.accelerator, tr.model, tr.device
    loss_name, beta, lmbda = setup.phase_at(cfg, step)  # a `switch` changes them mid-run
    window = micro_batches(tr, step, lmbda)
    A, world, ds_on = int(cfg.grad_accum), accelerator.num_processes, bool(cfg.deepspeed.enabled)
    n_local = sum(int(b["loss_mask"].sum()) for b, _ in window)
    n_tokens = n_window = int(accelerator.reduce(torch.tensor(n_local, device=device), "sum"))
    n_chains = 1.0
    if tr.mask_token_id is not None:  # the normaliser: the summed depth weights of all positions
        w_local = sum(float(b["packed"]["weight"].sum()) for b, _ in window)
        n_window = float(accelerator.reduce(torch.tensor(w_local, device=device), "sum"))
        c_local = sum(parallel.chain_count(b["packed"]) for b, _ in window)
        n_chains = float(accelerator.reduce(torch.tensor(c_local, device=device), "sum"))
    # DDP averages gradients over processes and DeepSpeed divides by its accumulation steps:
    # undo both so the gradient is exactly sum(token losses) / n_window.
    scale = world * (A if ds_on else 1)
    loss_sum = torch.zeros((), device=device)
    # The head only at loss positions needs the bare model (a DDP/DeepSpeed wrapper must run
    # its own forward to sync gradients): one plain process.
    masked = bool(cfg.masked_head) and accelerator.unwrap_model(model) is model and not ds_on
    for a, (batch, onp) in enumerate(window):
        packed = batch.pop("packed", None)
        batch = {k: v.to(device) for k, v in batch.items()}
        if packed is not None:
            packed = {k: v.to(device) for k, v in packed.items()}
        if ds_on:  # the engine's accumulation boundary comes from accelerate's counter
            boundary = accelerator.accumulate(model)
        else:
            sync = a == A - 1
            boundary = contextlib.nullcontext() if sync else accelerator.no_sync(model)
        with boundary:
            if ds_on and accelerator.sync_gradients != (a == A - 1):
                raise RuntimeError(f"DeepSpeed accumulation boundary out of step at {step}/{a}")
            temperature = float(cfg.loss.temperature)
            if tr.mapped is not None:  # another tokenizer: the TLI loss (train/mapped.py)
                loss = tr.mapped.loss(
                    tr, batch, masked, loss_name, beta, temperature, max(n_window, 1)
                )
            else:
                loss = _shared_vocab_loss(
                    tr, batch, packed, onp, masked, loss_name, beta, max(n_window, 1), n_chains
                )
            accelerator.backward(loss * scale)
        loss_sum += loss.detach()
    grad_norm = None
    if cfg.optim.max_grad_norm is not None and not ds_on:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
    elif ds_on:  # the engine clipped (and stepped) at the boundary; its pre-clip norm
        grad_norm = accelerator.deepspeed_engine_wrapped.get_global_grad_norm()
    tr.opt.step()
    tr.sched.step()
    tr.opt.zero_grad(set_to_none=True)
    rec = {
        "step": step + 1,
        "loss": float(accelerator.reduce(loss_sum, "sum")),
        "lr": tr.sched.get_last_lr()[0],
        "tokens": n_tokens,
    }
    if grad_norm is not None:
        rec["grad_norm"] = float(grad_norm)
    return rec


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
    cfg, step = tr.cfg, rec["step"]
    last = step == int(cfg.max_steps)
    if step % int(cfg.eval_every) == 0 or last:
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
    if step % int(cfg.save_every) == 0 or last:
        state["step"] = step
        state["examples_seen"] = tr.stream.examples_seen(step)
        state["stream"] = tr.stream.__dict__
        state["train_seconds"] += time.perf_counter() - t_train
        t_train = time.perf_counter()
        root = tr.out / "checkpoints"
        ckpt.save_checkpoint(tr.accelerator, root, step, state, int(cfg.keep_checkpoints))
    return t_train


def _best_drafter(tr: Trainer, state: dict[str, Any], step: int):
    """best/ as a model: the one in memory when the last step was the best, else from disk."""
    if state["best_step"] == step and zero.zero_stage(tr.cfg) != 3:  # ZeRO-3: params sharded
        return tr.accelerator.unwrap_model(tr.model)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tr.out / "best").to(tr.device)


def finish(tr: Trainer, state: dict[str, Any], step: int) -> DistillResult:
    """final/, the result (written by the main process) and the sweep summary if any."""
    cfg, out = tr.cfg, tr.out
    ckpt.export_pretrained(tr.accelerator, tr.model, tr.out_tok, out / "final")
    after = next((h for h in reversed(state["history"]) if "alpha" in h), None)
    before = state["before"]
    peak, peak_kind = _peak_memory(tr.device)
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
        loss=OmegaConf.to_container(cfg.loss, resolve=True),  # type: ignore[arg-type]
        lmbda=float(cfg.lmbda),
        data={
            "path": str(cfg.data.path or (out / "seqkd" if cfg.data.seq_kd else "")),
            "reference": bool(cfg.data.reference),
            "topk": tr.topk,
            "frozen_params": tr.frozen_params,
            "draft_vocab": len(getattr(unwrapped_config(tr), "draft_vocab_ids", None) or ()),
            "draft_vocab_train": tr.head_ids is not None,
            "train_examples": len(tr.train_examples),
            "eval_tokens": before["tokens"],
            "eval_source": cfg.eval.source,
            "eval_sampling": tr.eval_sampling.as_dict(),
            **({} if tr.mapped is None else tr.mapped.summary),
        },
        world_size=tr.accelerator.num_processes,
        history=state["history"],
        switch=OmegaConf.to_container(cfg.switch) if OmegaConf.select(cfg, "switch.at") else None,  # type: ignore[arg-type]
        parallel=None if tr.mask_token_id is None else parallel_summary(tr, state, after),
    )
    if tr.accelerator.is_main_process:
        if tr.mapped is None:  # the replay reads shared ids (train/predict.py)
            result.heldout_prediction = heldout_prediction(tr, _best_drafter(tr, state, step), cfg)
        atomic_write_json(out / "result.json", result)
        if OmegaConf.select(cfg, "sweep_dir"):
            write_summary(Path(str(cfg.sweep_dir)))
    tr.accelerator.end_training()
    return result


def unwrapped_config(tr: Trainer):
    return tr.accelerator.unwrap_model(tr.model).config


def parallel_summary(tr: Trainer, state: dict[str, Any], after: dict | None) -> dict[str, Any]:
    """result.json's `parallel` section: mask token, depth, per-depth acceptance before/after."""
    before = state["before"]
    best = next((h for h in state["history"] if h["step"] == state["best_step"]), before)
    return {
        "mask_token_id": tr.mask_token_id,
        "depth": int(tr.cfg.parallel.depth),
        "anchors": int(tr.cfg.parallel.anchors),
        "decay": float(tr.cfg.parallel.decay),
        "objective": str(tr.cfg.parallel.get("objective", "token")),
        "alpha_at_before": before["alpha_at"],
        "alpha_at_after": (after or before)["alpha_at"],
        "alpha_at_best": best.get("alpha_at", before["alpha_at"]),
        "accepted_length_before": before["accepted_length"],
        "accepted_length_best": state["best_score"],
        "round_accepted_before": before.get("round_accepted"),
        "round_accepted_best": best.get("round_accepted", before.get("round_accepted")),
    }


def run(cfg: DictConfig) -> DistillResult:
    tr = prepare(cfg)
    state = start_or_resume(tr)
    step, max_steps = int(state["step"]), int(cfg.max_steps)
    bar = tqdm(
        total=max_steps,
        initial=step,
        disable=not tr.accelerator.is_main_process,
        desc=f"distill[{cfg.loss.name}]",
        dynamic_ncols=True,
    )
    t_train = time.perf_counter()
    while step < max_steps:
        rec = train_step(tr, step)
        step = rec["step"]
        state["tokens"] += rec["tokens"]
        t_train = evaluate_and_save(tr, state, rec, t_train)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", alpha=f"{state['best_alpha']:.3f}")
        if STEP_HOOK is not None:
            STEP_HOOK(step)
    bar.close()
    state["train_seconds"] += time.perf_counter() - t_train
    return finish(tr, state, step)


@hydra.main(config_path="pkg://specdistill.conf", config_name="distill", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    res = run_or_exit(run, cfg)
    print(
        f"distill: alpha {res.alpha_before:.4f} -> {res.alpha_after:.4f} "
        f"(best {res.best_alpha:.4f} at step {res.best_step}); drafter: {res.drafter_path}"
    )


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
