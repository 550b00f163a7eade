"""The decoder's settings (`DecoderConfig`) and the checks that run before any decoding.

p = target, q = drafter, gamma = drafts per round. Every bad setting is one `ConfigError`
naming its config field, raised before weights are touched where possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdistill.data.models.pairs import check_vocab, vocab_size
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.draft_length import MIN_OVERHEAD, POLICIES, SCOPES, DraftCosts
from specdistill.decode.drafters import DRAFTING


@dataclass(frozen=True)
class DecoderConfig:
    """How to decode; `lenience` < 1 is DistillSpec's lossy rule (report it as lossy)."""

    gamma: int = 4
    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)
    lenience: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    cache: str = "auto"  # auto (static on CUDA, dynamic on CPU) | static | dynamic
    # auto: CUDA graphs on CUDA only; True: also inductor on CPU; "drafter": compile the drafter's
    # steps only (the target, and so the target-only baseline, stays eager)
    compile: str | bool = "auto"
    record_probs: bool = False  # keep the target's probabilities per verified position
    host_sync_every: int = 0  # target-only decoding: tokens reach the host every N steps; 0: auto
    # auto: on CPU, verify and catch-up steps (2-16 tokens) run linears as weight @ x.T, which
    # costs about one 1-token step (decode.cpu_matmul); linear: F.linear everywhere
    cpu_matmul: str = "auto"
    # Per-round draft length (decode.draft_length): fixed (gamma every round) | heuristic
    # (transformers' +2/-1 schedule from gamma) | confidence (expected gain of the drafter's
    # calibrated confidence); the adaptive ones draft at most `max_draft` per round, fall back to
    # plain target steps when drafting does not pay (`draft_floor`), and probe every `probe_every`
    # such steps. `draft_scope`: batch (one length for all rows) | row (each row its own).
    draft_length: str = "fixed"
    max_draft: int = 8
    draft_scope: str = "batch"
    draft_floor: bool = True
    probe_every: int = 8
    draft_costs: DraftCosts | None = None  # None: measured on the pair at first use
    # autoregressive: gamma drafter steps per round | parallel: one drafter forward over the
    # new tokens + gamma-1 mask tokens proposes all gamma (decode.drafters.parallel; PARD)
    drafting: str = "autoregressive"
    mask_token_id: int | None = None  # parallel: None reads the drafter's config.mask_token_id
    # auto: the drafter's head scores only its config's `draft_vocab_ids` when it has them (the
    # distill stage writes them for large vocabularies; decode.draft_vocab) | full: the whole head
    draft_vocab: str = "auto"

    @property
    def lossy(self) -> bool:
        return self.lenience != 1.0


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def check_decoder_config(cfg: DecoderConfig) -> None:
    """Reject bad settings before any decoding, naming the config field."""
    s = cfg.sampling
    if not isinstance(cfg.gamma, int) or cfg.gamma < 1:
        raise ConfigError(f"decoder.gamma={cfg.gamma!r} must be an integer >= 1 (or auto)")
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens!r} must be an integer >= 1")
    s.check("decoder.sampling")
    if not 0.0 < cfg.lenience <= 1.0:
        raise ConfigError(f"decoder.lenience={cfg.lenience} must lie in (0, 1] (1 = lossless)")
    if cfg.cache not in ("auto", "static", "dynamic"):
        raise ConfigError(f"decoder.cache={cfg.cache!r}: use auto, static or dynamic")
    if not isinstance(cfg.host_sync_every, int) or cfg.host_sync_every < 0:
        raise ConfigError(
            f"decoder.host_sync_every={cfg.host_sync_every!r} must be an integer >= 0 (0 = auto)"
        )
    if cfg.cpu_matmul not in ("auto", "linear"):
        raise ConfigError(f"decoder.cpu_matmul={cfg.cpu_matmul!r}: use auto or linear")
    if cfg.compile not in ("auto", True, False, "drafter"):
        raise ConfigError(f"decoder.compile={cfg.compile!r}: use auto, true, false or drafter")
    if cfg.draft_length not in POLICIES:
        raise ConfigError(f"decoder.draft_length={cfg.draft_length!r}: use {', '.join(POLICIES)}")
    if (
        isinstance(cfg.max_draft, bool)
        or not isinstance(cfg.max_draft, int)
        or not (1 <= cfg.max_draft <= 15)
    ):
        raise ConfigError(f"decoder.max_draft={cfg.max_draft!r} must be an integer in 1..15")
    if cfg.draft_scope not in SCOPES:
        raise ConfigError(f"decoder.draft_scope={cfg.draft_scope!r}: use {' or '.join(SCOPES)}")
    if not isinstance(cfg.draft_floor, bool):
        raise ConfigError(f"decoder.draft_floor={cfg.draft_floor!r} must be true or false")
    if (
        isinstance(cfg.probe_every, bool)
        or not isinstance(cfg.probe_every, int)
        or not (1 <= cfg.probe_every <= 64)
    ):
        raise ConfigError(f"decoder.probe_every={cfg.probe_every!r} must be an integer in 1..64")
    if cfg.draft_costs is not None:
        dc = cfg.draft_costs
        for name in ("c", "verify_per_token", "round_overhead", "draft_per_token"):
            v = getattr(dc, name)
            low = MIN_OVERHEAD if name == "round_overhead" else 0  # a verify may undercut a step
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v < 100:
                raise ConfigError(f"decoder.draft_{name}={v!r} must be a number >= {low} (or auto)")
    if cfg.drafting not in DRAFTING:
        raise ConfigError(f"decoder.drafting={cfg.drafting!r}: use {' or '.join(DRAFTING)}")
    if cfg.draft_vocab not in ("auto", "full"):
        raise ConfigError(
            f"decoder.draft_vocab={cfg.draft_vocab!r}: use auto (the drafter's config "
            "draft_vocab_ids when present) or full"
        )
    if cfg.compile is True and cfg.cache == "dynamic":
        raise ConfigError(
            "decoder.compile=true compiles fixed-shape steps over a static cache: "
            "set decoder.cache=static or auto"
        )


def check_pair_for_decoding(target, drafter, tokenizer_len: int | None = None) -> int:
    """Same device, same dtype, compatible vocabularies; returns the common vocab size."""
    t_dev, t_dtype = model_device_dtype(target)
    d_dev, d_dtype = model_device_dtype(drafter)
    if t_dev != d_dev:
        raise ConfigError(
            f"pair.drafter is on {d_dev} but pair.target is on {t_dev}: load both on one device"
        )
    if t_dtype != d_dtype:
        raise ConfigError(
            f"pair.drafter has dtype {d_dtype} but pair.target has {t_dtype}: load both with the "
            "same dtype (the `dtype` setting)"
        )
    tv, dv = vocab_size(target), vocab_size(drafter)
    if tokenizer_len is None:
        if tv != dv:
            raise ConfigError(
                f"target and drafter vocab sizes differ ({tv} vs {dv}): pass the tokenizer's "
                "length so padding can be told apart from a different tokenizer (pair.tokenizer)"
            )
        tokenizer_len = tv
    return check_vocab(tv, dv, tokenizer_len)
