"""The online stage's config typed once: `OnlineSettings.from_cfg(cfg)` at the top of `run`
holds the stage's own settings, every check (each error names its field, before any model
loads) and the typed `decoder` node. conf/online.yaml is the one home of each key's default,
with why: the fields here have none (tests/test_single_default.py), and a config built by hand
without a key is one error naming it. The `loss`, `optim` and `logger` groups stay nodes: the
optimizer is instantiated from `optim.optimizer`'s `_target_` and the loss node is shared with
the distill stage's loss code."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError, number_as_float, required
from specdistill.decode.config import DecoderSettings
from specdistill.decode.config import removed_keys as removed_decoder_keys
from specdistill.distill.losses import DIVERGENCES
from specdistill.distill.online.buffer import RECORD_MODES
from specdistill.distill.online.stream import Segment, parse_stream

_POSITIVE = (
    "batch_size",
    "max_new_tokens",
    "max_prompt_tokens",
    "window",
    "buffer_tokens",
    "update_every",
    "update_steps",
    "update_batch",
    "save_every",
)
# `topk: auto` per serving mode. Greedy acceptance only asks whether q's argmax is p's, which
# a few top tokens decide. Sampled acceptance is sum_x min(p, q) = 1 - TV(p, q): all of p
# counts, and a small top-k leaves most of a high-entropy p in one rest bucket whose shape the
# (K+1)-way loss cannot see (on the toy pair at T=1 a top-32 leaves much of p's mass in that
# bucket, a top-4096 none of it, and the small K's updates lowered sampled alpha where the full
# one's raised it: distill/RESULTS.md, "Online adaptation"). 4096 kept positions
# at K=4096 take 128 MB (int32 id + fp32 log-prob per entry).
TOPK_GREEDY = 32
TOPK_SAMPLING = 4096
# Settings that do not change what a run computes: a resumed run may change them.
_RUN_ONLY = (
    "resume", "output_dir", "logger", "device", "threads", "prefill_threads", "plot", "hydra",
    "run_key",  # the pipeline's step fingerprint: compared on its own (util.saved_state)
)  # fmt: skip


def removed_keys() -> dict[str, str]:
    """The stage's removed settings (dotted key -> its one-line refusal), refused alike by
    `decoder_settings` and the stage's command line (data/stage_config.py)."""
    return removed_decoder_keys("decoder")


def _int(cfg: DictConfig, key: str) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    return value


def _in_range_or_null(value, lo: float, hi: float) -> bool:
    if value is None:
        return True
    return not isinstance(value, bool) and isinstance(value, int | float) and lo <= value <= hi


def _resume(value: Any) -> bool | str:
    """`resume`: auto, true or false."""
    if value not in (True, False, "auto"):
        raise ConfigError(
            f"resume={value!r}: use auto (continue this run's own state), true or false"
        )
    return value


@dataclass(frozen=True)
class OnlineSettings:
    """conf/online.yaml's own settings, checked (`loss`, `optim`, `logger` stay nodes)."""

    output_dir: Path
    decoder: DecoderSettings
    segments: tuple[Segment, ...]
    batch_size: int
    max_new_tokens: int
    max_prompt_tokens: int
    window: int
    buffer_tokens: int
    update_every: int
    update_steps: int
    update_batch: int
    save_every: int
    topk: int | str  # auto: by the decoder's serving mode (resolve_topk)
    stream_blend: int
    record: str
    guard_every: int
    guard_probe: int
    guard_margin: float
    guard_start: bool
    gate_agreement: float | str | None  # auto: by serving mode (resolve_gate)
    gate_relax_margin: float | None
    gate_relaxed: float | None
    anchor_kl: float
    loss_chunk_size: int
    compare_frozen: bool
    seed: int
    resume: bool | str  # auto: continue this run's own state (saved_state)
    device: str
    dtype: str
    threads: Any  # default | auto | N (data.runtime.set_threads checks it)
    log_tokens: bool
    plot: bool

    @property
    def gate(self) -> float | None:
        """The agreement gate's threshold for this decoder's serving mode (None: no gate)."""
        return resolve_gate(self.gate_agreement, self.decoder.sampling.temperature)

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> OnlineSettings:
        """The online config checked and typed; a ConfigError names the field."""
        segments = _check(cfg)
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            decoder=decoder_settings(cfg),
            segments=tuple(segments),
            **{key: int(cfg[key]) for key in _POSITIVE},
            topk=cfg.topk,
            stream_blend=int(cfg.stream_blend),
            record=str(cfg.record),
            guard_every=int(cfg.guard_every),
            guard_probe=int(cfg.guard_probe),
            guard_margin=float(cfg.guard_margin),
            guard_start=bool(required(cfg, "guard_start")),
            gate_agreement=number_as_float(required(cfg, "gate_agreement")),
            gate_relax_margin=number_as_float(required(cfg, "gate_relax_margin")),
            gate_relaxed=number_as_float(required(cfg, "gate_relaxed")),
            anchor_kl=float(required(cfg, "anchor_kl")),
            loss_chunk_size=int(required(cfg, "loss_chunk_size")),
            compare_frozen=bool(required(cfg, "compare_frozen")),
            seed=int(required(cfg, "seed")),
            resume=_resume(required(cfg, "resume")),
            device=str(required(cfg, "device")),
            dtype=str(required(cfg, "dtype")),
            threads=required(cfg, "threads"),
            log_tokens=bool(required(cfg, "log_tokens")),
            plot=bool(required(cfg, "plot")),
        )


def check_config(cfg: DictConfig) -> OnlineSettings:
    """The online config typed, once every setting is known to be usable."""
    return OnlineSettings.from_cfg(cfg)


def _check(cfg: DictConfig) -> list[Segment]:
    """The stream's segments, once every setting is known to be usable."""
    for key in _POSITIVE:
        if _int(cfg, key) <= 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be a positive integer")
    topk = cfg.topk
    if topk != "auto" and (isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0):
        raise ConfigError(f"topk={topk!r} must be a positive integer or auto (by decoder mode)")
    segments = parse_stream(cfg.stream)
    b = int(cfg.batch_size)
    for key in ("window", "update_every"):
        if int(cfg[key]) % b:
            raise ConfigError(f"{key}={cfg[key]} must be a multiple of batch_size={b}")
    if _int(cfg, "stream_blend") < 0:
        raise ConfigError(f"stream_blend={cfg.stream_blend} must be >= 0 (0: sharp shifts)")
    if cfg.record not in RECORD_MODES:
        raise ConfigError(f"record={cfg.record!r}: use one of {', '.join(RECORD_MODES)}")
    if _int(cfg, "guard_every") < 0:
        raise ConfigError(f"guard_every={cfg.guard_every} must be >= 0 (0: no guard)")
    if int(cfg.guard_every) > 0:
        probe = _int(cfg, "guard_probe")
        if probe <= 0 or probe > int(cfg.update_every) or probe % b:
            raise ConfigError(
                f"guard_probe={probe} must be a positive multiple of batch_size={b} and at most "
                f"update_every={cfg.update_every} (the probe is the latest traffic)"
            )
    gate = required(cfg, "gate_agreement")
    if gate is not None and gate != "auto":
        if isinstance(gate, bool) or not isinstance(gate, int | float) or not -1 <= gate <= 1:
            raise ConfigError(
                f"gate_agreement={gate!r} must be a cosine in [-1, 1], auto or null (no gate)"
            )
        if int(cfg.update_batch) < 2:
            raise ConfigError(
                f"update_batch={cfg.update_batch} must be >= 2 with gate_agreement (it is split "
                "into two half-batches whose gradients must agree)"
            )
    if not _in_range_or_null(required(cfg, "gate_relax_margin"), 0, 1):
        raise ConfigError(
            f"gate_relax_margin={cfg.get('gate_relax_margin')!r} must be an alpha drop in [0, 1] "
            "or null (the gate never relaxes)"
        )
    if not _in_range_or_null(required(cfg, "gate_relaxed"), -1, 1):
        raise ConfigError(
            f"gate_relaxed={cfg.get('gate_relaxed')!r} must be a cosine in [-1, 1] or null (no "
            "gate while relaxed)"
        )
    if not float(required(cfg, "anchor_kl")) >= 0:
        raise ConfigError(f"anchor_kl={cfg.anchor_kl} must be >= 0 (0: no trust region)")
    if not float(cfg.guard_margin) >= 0:
        raise ConfigError(f"guard_margin={cfg.guard_margin} must be >= 0")
    if cfg.loss.name not in DIVERGENCES:
        raise ConfigError(f"loss.name={cfg.loss.name!r} is not one of {', '.join(DIVERGENCES)}")
    if not 0.0 <= float(cfg.loss.beta) <= 1.0:
        raise ConfigError(f"loss.beta={cfg.loss.beta} must lie in [0, 1]")
    if float(cfg.loss.temperature) != 1.0:
        raise ConfigError(
            f"loss.temperature={cfg.loss.temperature}: online updates train on the target's "
            "temperature-1 probabilities from verification; set loss.temperature=1"
        )
    if cfg.optim.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"optim.schedule={cfg.optim.schedule!r}: use cosine, linear or constant")
    return segments


def decoder_settings(cfg: DictConfig) -> DecoderSettings:
    """The `decoder` node typed and checked, with what online adaptation needs of it: fixed-
    gamma rounds of autoregressive drafts."""
    settings = DecoderSettings.from_node(cfg.decoder, "decoder")
    if settings.draft_length != "fixed":
        raise ConfigError(
            f"decoder.draft_length={settings.draft_length} is not supported online: online "
            "adaptation trains on fixed-gamma rounds (each round's gamma verified positions); "
            "set decoder.draft_length=fixed"
        )
    if settings.drafting != "autoregressive":
        raise ConfigError(
            f"decoder.drafting={settings.drafting} is not supported online: online updates "
            "train autoregressive drafts only; set decoder.drafting=autoregressive"
        )
    return settings


# `gate_agreement: auto` per serving mode. Greedy acceptance hangs on the argmax alone: on its
# own domain a distilled drafter's half-batch gradients barely agree and steps taken there lose
# alpha, so the greedy gate is strict and passes shifted traffic. Sampled acceptance (1 - TV)
# gains from any real FKL progress, so its gate is looser (distill/RESULTS.md, online
# adaptation). After a shift the replay buffer mixes domains; `gate_relax_margin` relaxes the
# gate while served alpha is well below its best (specdistill.distill.online.drift).
GATE_GREEDY = 0.6
GATE_SAMPLING = 0.3


def resolve_gate(gate, temperature: float) -> float | None:
    """The agreement threshold: `auto` is GATE_GREEDY at temperature 0, else GATE_SAMPLING."""
    if gate == "auto":
        return GATE_GREEDY if float(temperature) == 0 else GATE_SAMPLING
    return None if gate is None else float(gate)


def resolve_topk(topk: int | str, temperature: float, vocab: int) -> int:
    """The target top-k kept per position: `auto` is TOPK_GREEDY for greedy decoding
    (temperature 0) and TOPK_SAMPLING for sampling, capped at the vocabulary."""
    if topk == "auto":
        return min(vocab, TOPK_GREEDY if float(temperature) == 0 else TOPK_SAMPLING)
    return int(topk)


def check_topk(settings: OnlineSettings, vocab: int) -> int:
    """The resolved top-k, once it fits the vocabulary."""
    k = resolve_topk(settings.topk, settings.decoder.sampling.temperature, vocab)
    if k > vocab:
        raise ConfigError(
            f"topk={settings.topk} is larger than the vocabulary ({vocab} tokens): use topk <= "
            f"{vocab}"
        )
    return k


def fingerprint(cfg: DictConfig, plan_fp: str) -> str:
    """What a resumed run must share with the run it continues."""
    keep = {
        k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in _RUN_ONLY
    }
    text = OmegaConf.to_yaml(OmegaConf.create(keep), sort_keys=True) + plan_fp
    return hashlib.sha256(text.encode()).hexdigest()[:16]
