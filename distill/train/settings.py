"""The distill stage's config typed once: `TrainSettings.from_cfg(cfg)` at the top of `run`.

conf/distill.yaml is the one home of every key's default, with why (the fields here and in
settings_sections.py have none: tests/test_single_default.py); the types and every check of the
stage's own settings live here, each error one line naming the field (a config built by hand
without a key too), before any model loads. The loop, its helpers and result.json read typed
fields instead of parsing nodes again. The config groups that are objects of their own stay
nodes on the config: `pair` and `dataset` (resolved by data/), `optim` (its optimizer is
instantiated from `_target_`; its schedule is checked here), `deepspeed` (distill/train/zero.py)
and `logger`. What needs the machine (DeepSpeed's offload devices, fp16 on CPU) is checked by
`setup.check_config`, still before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError, required
from specdistill.data.sampling import replaced_keys
from specdistill.decode.draft_vocab import draft_vocab_size
from specdistill.distill.head_loss import AUTO_MIN_VOCAB
from specdistill.distill.losses import DIVERGENCES
from specdistill.distill.train.fsdp import check_fsdp
from specdistill.distill.train.settings_sections import (
    DataSettings,
    EvalSettings,
    LossSettings,
    OnpolicySettings,
    ParallelSettings,
    SwitchSettings,
)
from specdistill.distill.train.zero import zero_stage

_POSITIVE = ("max_steps", "micro_batch_size", "grad_accum", "eval_every", "save_every")
_AUTO_OR_BOOL = ("auto", True, False)
_AUTO_OR_BOOL_KEYS = (
    "chunked_loss",
    "tli_mask_unreachable",
    "freeze_embeddings",
    "draft_vocab_train",
    "resume",
)


# draft_vocab_train=auto: heads of this many rows or more train over their draft vocabulary
# (Llama 3's 128k, Qwen's 152k, Gemma's 262k; not SmolLM2's 49k)
DRAFT_VOCAB_TRAIN_MIN = 131072


def removed_keys() -> dict[str, str]:
    """The stage's removed settings (dotted key -> its one-line refusal), refused alike by
    `TrainSettings.from_cfg` and the stage's command line (data/stage_config.py): the per-key
    sampling spelling beside `onpolicy.sampling` and `eval.sampling`."""
    return {**replaced_keys("onpolicy.sampling"), **replaced_keys("eval.sampling")}


@dataclass(frozen=True)
class TrainSettings:
    """conf/distill.yaml's own settings, checked; see the module docstring for what stays a node."""

    output_dir: Path
    loss: LossSettings
    data: DataSettings
    eval: EvalSettings
    onpolicy: OnpolicySettings
    lmbda: float
    switch: SwitchSettings
    seed: int
    max_steps: int
    micro_batch_size: int
    grad_accum: int
    max_seq_len: int
    # auto: continue from the latest checkpoint of the same config (a preempted or killed run's
    # rerun); true: from the latest checkpoint whatever changed but the data layout; false: afresh
    resume: bool | str
    eval_every: int
    save_every: int
    keep_checkpoints: int
    mixed_precision: str  # auto | no | bf16 | fp16
    device: str
    target_dtype: str
    loss_chunk_size: int | None
    group_by_length: int  # micro-batches whose rows are sorted by length together (0: off)
    pack_sequences: bool  # a micro-batch's sequences end to end in rows (train/packing.py)
    gradient_checkpointing: bool  # the drafter's layers recompute activations in backward
    drafting: str  # autoregressive | parallel
    parallel: ParallelSettings | None  # drafting=parallel only
    masked_head: bool
    chunked_loss: bool | str
    draft_vocab: Any  # auto | none | N (decode/draft_vocab.py checks the form)
    # auto: on for heads of >= DRAFT_VOCAB_TRAIN_MIN rows (`trains_draft_vocab`)
    draft_vocab_train: bool | str
    # greedy serving: positions whose target argmax q can never propose (outside a mapped pair's
    # vocabulary intersection, or outside the draft vocabulary under draft_vocab_train) add no
    # loss; resolved by `mask_unreachable`
    tli_mask_unreachable: bool | str
    freeze_embeddings: bool | str
    deepspeed: bool
    zero_stage: int  # 0 without DeepSpeed
    fsdp: bool  # FSDP2: the drafter sharded with torch's fully_shard (train/fsdp.py)
    # a loss sweep's folder, its summary rewritten after each run: an experiment's key
    # (conf/experiment/loss_sweep.yaml), not the stage's, so absent (None) means no sweep
    sweep_dir: str | None

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> TrainSettings:
        """The distill config checked and typed; a ConfigError names the field."""
        _check_scalars(cfg)
        for key in _AUTO_OR_BOOL_KEYS:
            value = required(cfg, key)
            if value not in _AUTO_OR_BOOL:
                raise ConfigError(f"{key}={value!r}: use auto, true or false")
        ev = EvalSettings.from_node(cfg.eval)
        onpolicy = OnpolicySettings.from_node(cfg.onpolicy)
        switch = SwitchSettings.from_node(required(cfg, "switch"))
        drafting = required(cfg, "drafting")
        if drafting not in ("autoregressive", "parallel"):
            raise ConfigError(f"drafting={drafting!r}: use autoregressive or parallel")
        par = ParallelSettings.from_node(cfg.parallel) if drafting == "parallel" else None
        if cfg.optim.schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(
                f"optim.schedule={cfg.optim.schedule!r}: use cosine, linear or constant"
            )
        draft_vocab = required(cfg, "draft_vocab")
        draft_vocab_size(draft_vocab, 1 << 30)  # the setting's form only
        sweep_dir = OmegaConf.select(cfg, "sweep_dir")
        sharded = _fsdp(_bool(cfg, "fsdp"), cfg, drafting)
        return cls(
            output_dir=Path(str(cfg.output_dir)),
            loss=LossSettings(
                str(cfg.loss.name), float(cfg.loss.beta), float(cfg.loss.temperature)
            ),
            data=DataSettings.from_node(cfg.data),
            eval=ev,
            onpolicy=onpolicy,
            lmbda=float(cfg.lmbda),
            switch=switch,
            seed=int(required(cfg, "seed")),
            **{key: int(cfg[key]) for key in (*_POSITIVE, "max_seq_len")},
            resume=required(cfg, "resume"),
            keep_checkpoints=int(required(cfg, "keep_checkpoints")),
            mixed_precision=str(required(cfg, "mixed_precision")),
            device=str(required(cfg, "device")),
            target_dtype=str(required(cfg, "target_dtype")),
            loss_chunk_size=_int_or_none(required(cfg, "loss_chunk_size")),
            group_by_length=int(required(cfg, "group_by_length")),
            pack_sequences=_pack_sequences(_bool(cfg, "pack_sequences"), drafting),
            gradient_checkpointing=_bool(cfg, "gradient_checkpointing"),
            drafting=str(drafting),
            parallel=par,
            masked_head=bool(required(cfg, "masked_head")),
            chunked_loss=required(cfg, "chunked_loss"),
            draft_vocab=draft_vocab,
            draft_vocab_train=required(cfg, "draft_vocab_train"),
            tli_mask_unreachable=required(cfg, "tli_mask_unreachable"),
            freeze_embeddings=required(cfg, "freeze_embeddings"),
            deepspeed=bool(cfg.deepspeed.enabled),
            zero_stage=zero_stage(cfg),
            fsdp=sharded,
            sweep_dir=None if not sweep_dir else str(sweep_dir),
        )

    def trains_draft_vocab(self, head_rows: int) -> bool:
        """Whether a drafter whose head has `head_rows` rows trains over its draft vocabulary
        (`draft_vocab_train`; where it applies at all: shared_vocab.train_head_ids). auto: from
        DRAFT_VOCAB_TRAIN_MIN rows on, where the head is most of a step and the
        draft-vocabulary loss keeps the held-out acceptance (distill/RESULTS.md); below it the
        full head's cost is modest, and the default keeps it."""
        if self.draft_vocab_train == "auto":
            return head_rows >= DRAFT_VOCAB_TRAIN_MIN
        return bool(self.draft_vocab_train)

    @property
    def most_onpolicy(self) -> float:
        """The largest on-policy share of the run (either phase): stored top-k rows cannot
        serve a run that ever samples from the drafter."""
        return max(self.lmbda, self.switch.lmbda or 0.0)

    def phase_at(self, step: int) -> tuple[str, float, float]:
        """(loss name, beta, lmbda) for optimizer step `step` (0-based): the switch's settings
        from step int(switch.at * max_steps) on, the stage's own before (or without a switch)."""
        name, beta, lmbda = self.loss.name, self.loss.beta, self.lmbda
        sw = self.switch
        if sw.at is None or step < int(sw.at * self.max_steps):
            return name, beta, lmbda
        if sw.loss is not None and sw.loss != name:
            name, beta = sw.loss, {"fkl": 0.0, "rkl": 1.0}.get(sw.loss, 0.5)
        if sw.beta is not None:
            beta = sw.beta
        if sw.lmbda is not None:
            lmbda = sw.lmbda
        return name, beta, lmbda

    @property
    def mask_unreachable(self) -> bool:
        """`tli_mask_unreachable` resolved (auto: on when eval.sampling is greedy), for both
        losses that restrict q to a set I of target ids (distill/intersection.py): a mapped
        pair's vocabulary intersection and the draft vocabulary (`draft_vocab_train`). A greedy
        draft is accepted only when it is the target's argmax, so where that argmax lies outside
        I no q is ever accepted and the position's gradient only spends capacity."""
        if self.tli_mask_unreachable == "auto":
            return self.eval.sampling.greedy
        return bool(self.tli_mask_unreachable)

    def use_chunked_loss(self, vocab: int) -> bool:
        """`chunked_loss`: compute the loss from the drafter's hidden states and head in chunks
        of positions, never the full [N, V] logits (distill/head_loss.py; exact, same value).
        auto: on for vocabularies >= head_loss.AUTO_MIN_VOCAB, where the head's logits dominate
        a step (distill/RESULTS.md). Applies to the plain-process masked-head path
        (`masked_head`) of a plain-head model; the draft-vocabulary head (`draft_vocab_train`)
        keeps its own path."""
        if self.chunked_loss == "auto":
            return vocab >= AUTO_MIN_VOCAB
        return bool(self.chunked_loss)


def _check_scalars(cfg: DictConfig) -> None:
    """The loss, the on-policy share and the loop's sizes, each one line naming the field."""
    for key in ("lmbda", "loss.beta"):
        value = OmegaConf.select(cfg, key)
        if value is None or not 0.0 <= float(value) <= 1.0:
            raise ConfigError(
                f"{key}={value} must lie in [0, 1] (see DESIGN.md at the root: GKD naming)"
            )
    if cfg.loss.name not in DIVERGENCES:
        raise ConfigError(f"loss.name={cfg.loss.name!r} is not one of {', '.join(DIVERGENCES)}")
    if float(cfg.loss.temperature) <= 0:
        raise ConfigError(f"loss.temperature={cfg.loss.temperature} must be positive")
    for key in _POSITIVE:
        if int(OmegaConf.select(cfg, key)) <= 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be a positive integer")
    if int(cfg.max_seq_len) < 2:
        raise ConfigError(f"max_seq_len={cfg.max_seq_len} must be at least 2")
    chunk = required(cfg, "loss_chunk_size")
    if chunk is not None and int(chunk) <= 0:
        raise ConfigError(f"loss_chunk_size={chunk} must be positive or null")
    group = required(cfg, "group_by_length")
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ConfigError(
            f"group_by_length={group!r} must be a whole number of micro-batches (0: off)"
        )
    if cfg.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision={cfg.mixed_precision!r}: use auto, no, bf16 or fp16")


def _bool(cfg: Any, key: str) -> bool:
    value = required(cfg, key)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: use true or false")
    return value


def _fsdp(sharded: bool, cfg: DictConfig, drafting: str) -> bool:
    """`fsdp`, checked against what FSDP2 does not serve (train/fsdp.py) and fp16."""
    check_fsdp(sharded, bool(cfg.deepspeed.enabled), False, drafting == "parallel")
    if sharded and cfg.mixed_precision == "fp16":
        raise ConfigError("fsdp=true with mixed_precision=fp16 (no loss scaler): use bf16 or no")
    return sharded


def _pack_sequences(value: bool, drafting: str) -> bool:
    """`pack_sequences`, checked: not for a parallel drafter (its batches carry mask chains
    laid out by distill/parallel.py)."""
    if value and drafting == "parallel":
        raise ConfigError(
            "pack_sequences=true with drafting=parallel: a parallel drafter's batches carry "
            "mask chains laid out per row (distill/parallel.py); set pack_sequences=false"
        )
    return value


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
