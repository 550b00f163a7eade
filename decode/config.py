"""The decoder's settings and the checks that run before any decoding.

Two types, one per side of the config boundary. `DecoderSettings` is the `decoder` config node
typed once (`DecoderSettings.from_node(cfg.decoder)`): every key of conf/decoder/*.yaml with its
default, gamma `auto` as None, `draft_costs` as DraftCosts, checked. `DecoderConfig` is what one
`SpeculativeDecoder` runs with: the node's settings plus what the stage adds (a resolved gamma,
max_new_tokens, the tokenizer's EOS ids). The defaults live here and nowhere else;
tests/decode/test_decoder_settings.py holds the yaml's listed values equal to them.

p = target, q = drafter, gamma = drafts per round. Every bad setting is one `ConfigError`
naming its config field, raised before weights are touched where possible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specdistill.data.models.pairs import check_vocab, vocab_size
from specdistill.data.runtime import ConfigError, number_as_float
from specdistill.data.sampling import Sampling
from specdistill.decode.draft_length import (
    MIN_OVERHEAD,
    POLICIES,
    SCOPES,
    DraftCosts,
    costs_from_mapping,
)
from specdistill.decode.drafters import DRAFTING
from specdistill.decode.drafters.context import check_drafter_context
from specdistill.decode.drafters.mapped import check_context

VERIFY_COSTS = ("by_width", "linear")  # how measured draft costs price the verify widths
# decoder.prefill_dtype -> the dtype a prompt's prefill runs under (autocast; None: the model's)
PREFILL_DTYPES = {"model": None, "bf16": torch.bfloat16}
DEFAULT_GAMMA = 4  # drafts per round when the config does not say; also gamma=auto's pilot
DEFAULT_MAX_GAMMA = 12  # gamma=auto searches 1..max_gamma


@dataclass(frozen=True)
class DecoderConfig:
    """How to decode; `lenience` < 1 is DistillSpec's lossy rule (report it as lossy)."""

    gamma: int = DEFAULT_GAMMA
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
    # CPU linears of few-row steps (decode.cpu_matmul): linear (the default, as the stages'):
    # F.linear everywhere, so no kernel is picked by timing; opt-in for benchmarks: weight_major
    # runs verify and catch-up steps (2-16 tokens) as weight @ x.T, packed through oneDNN over
    # weights reordered once (a second copy, float32 only), auto times the three per model on
    # this machine (decode.matmul_choice)
    cpu_matmul: str = "linear"
    # decode steps of a Llama-family model computed layer by layer without transformers'
    # per-call machinery (decode.lean_step; prefill and other models keep model.forward)
    lean_steps: bool = True
    # Per-round draft length (decode.draft_length): fixed (gamma every round) | heuristic
    # (transformers' +2/-1 schedule from gamma) | confidence (expected gain of the drafter's
    # calibrated confidence); the adaptive ones draft at most `max_draft` per round, fall back to
    # plain target steps when drafting does not pay (`draft_floor`), and probe every `probe_every`
    # such steps. `draft_scope`: batch (one length for all rows) | row (each row its own).
    # The library's decoder stays classic (a given gamma every round); the stages' default
    # (`DecoderSettings`, conf/decoder) is the adaptive policy that measured best.
    draft_length: str = "fixed"
    max_draft: int = 8
    draft_scope: str = "batch"
    draft_floor: bool = True
    probe_every: int = 8
    draft_costs: DraftCosts | None = None  # None: measured on the pair at first use
    # by_width: the measured costs time every verify width 1..max_draft (kernels favour some
    # widths: 3 drafts can cost less than 2) | linear: a line through 1 and max_draft drafts
    verify_costs: str = "by_width"
    # autoregressive: gamma drafter steps per round | parallel: one drafter forward over the
    # new tokens + gamma-1 mask tokens proposes all gamma (decode.drafters.parallel; PARD)
    drafting: str = "autoregressive"
    mask_token_id: int | None = None  # parallel: None reads the drafter's config.mask_token_id
    # auto: the drafter's head scores only its config's `draft_vocab_ids` when it has them (the
    # distill stage writes them for large vocabularies; decode.draft_vocab) | full: the whole head
    draft_vocab: str = "auto"
    # prompt lookup (decode.lookup): at batch 1, a round whose context's last n-gram occurred
    # before verifies the tokens that followed it (no drafter forward); other rounds as before
    lookup: bool = False
    # how much of the prompt the drafter reads (decode.drafters.context): auto (all of it within
    # its own trained positions) | all | N (the last N prompt tokens)
    drafter_context: int | str = "auto"
    # model: prompt prefills in the models' own dtype | bf16: under bf16 autocast (decode steps
    # and the caches keep the model's dtype; ModelRunner._cast_prefill)
    prefill_dtype: str = "model"

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
    if not isinstance(cfg.lenience, int | float) or not 0.0 < cfg.lenience <= 1.0:
        raise ConfigError(f"decoder.lenience={cfg.lenience} must lie in (0, 1] (1 = lossless)")
    if cfg.cache not in ("auto", "static", "dynamic"):
        raise ConfigError(f"decoder.cache={cfg.cache!r}: use auto, static or dynamic")
    if not isinstance(cfg.host_sync_every, int) or cfg.host_sync_every < 0:
        raise ConfigError(
            f"decoder.host_sync_every={cfg.host_sync_every!r} must be an integer >= 0 (0 = auto)"
        )
    if cfg.cpu_matmul not in ("auto", "weight_major", "packed", "linear"):
        raise ConfigError(
            f"decoder.cpu_matmul={cfg.cpu_matmul!r}: use auto, weight_major, packed or linear"
        )
    if not isinstance(cfg.lean_steps, bool):
        raise ConfigError(f"decoder.lean_steps={cfg.lean_steps!r} must be true or false")
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
        for name in (
            "c",
            "verify_per_token",
            "round_overhead",
            "draft_per_token",
            "glue_per_draft",
            "prefill_per_token",
            "prefill_fixed",
        ):
            v = getattr(dc, name)
            low = MIN_OVERHEAD if name == "round_overhead" else 0  # a verify may undercut a step
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v < 100:
                raise ConfigError(f"decoder.draft_{name}={v!r} must be a number >= {low} (or auto)")
        # an entry may be negative (a width cheaper than the line's base); a verify may not
        # cost nothing
        if any(not (-1 < dc.round_overhead + v < 100) for v in dc.verify_tokens):
            raise ConfigError(
                f"decoder.draft_costs.verify_tokens={list(dc.verify_tokens)}: each entry (what "
                "1, 2, ... drafts add to the verify, in target steps) must leave the verify a "
                "positive cost, 1 + round_overhead + entry > 0"
            )
    if cfg.verify_costs not in VERIFY_COSTS:
        raise ConfigError(
            f"decoder.verify_costs={cfg.verify_costs!r}: use by_width (every verify width "
            "timed) or linear (a line through 1 and max_draft drafts)"
        )
    if not isinstance(cfg.lookup, bool):
        raise ConfigError(f"decoder.lookup={cfg.lookup!r} must be true or false")
    check_drafter_context(cfg.drafter_context)
    if cfg.prefill_dtype not in PREFILL_DTYPES:
        raise ConfigError(
            f"decoder.prefill_dtype={cfg.prefill_dtype!r}: use model (prefill in the models' "
            "own dtype) or bf16 (prefill matmuls in bfloat16, the cache kept in the model's)"
        )
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


# The `decoder` node's keys that DecoderSettings carries straight into DecoderConfig.
_SHARED = (
    "sampling", "lenience", "cache", "compile", "record_probs", "host_sync_every", "cpu_matmul",
    "lean_steps", "draft_length", "max_draft", "draft_scope", "draft_floor", "probe_every", "draft_costs",
    "verify_costs", "drafting", "mask_token_id", "draft_vocab", "lookup", "drafter_context",
    "prefill_dtype",
)  # fmt: skip


@dataclass(frozen=True)
class DecoderSettings:
    """The `decoder` config node, typed once: what conf/decoder/*.yaml lists, with its defaults.

    Built by `from_node` at the top of a stage and passed down as a value, so no stage parses
    the node again. gamma None means `auto` (validate picks it from a pilot run, searching
    1..max_gamma). `decoder_config` turns it into the DecoderConfig one decoder runs with.
    """

    gamma: int | None = DEFAULT_GAMMA
    max_gamma: int = DEFAULT_MAX_GAMMA
    sampling: Sampling = field(default_factory=Sampling)
    lenience: float = 1.0
    cache: str = "auto"
    compile: str | bool = "auto"
    record_probs: bool = False
    host_sync_every: int = 0
    # linear: plain F.linear steps on every CPU; no kernel is picked by timing at start-up (a
    # timed pick chose a bf16 oneDNN path an AVX2-only CPU cannot run, and made decoded rounds
    # depend on the machine). weight_major / packed / auto stay opt-in for benchmarks.
    cpu_matmul: str = "linear"
    lean_steps: bool = True
    # fixed: gamma drafts every round, the way vLLM, SGLang and TRT-LLM serve a drafter, so
    # validate's tau and acceptance by position are the engines' and need no timing
    draft_length: str = "fixed"
    max_draft: int = 8
    draft_scope: str = "batch"
    draft_floor: bool = True
    probe_every: int = 8
    draft_costs: DraftCosts | None = None  # yaml `auto`: measured on the pair at first use
    verify_costs: str = "by_width"
    drafting: str = "autoregressive"
    mask_token_id: int | None = None
    draft_vocab: str = "auto"
    # prompt lookup is a drafter of its own in the engines (vLLM's ngram): opt-in, so the
    # figures of record are the drafter's (auto: greedy decodes only)
    lookup: bool | str = False
    # the stages' drafter reads the prompt's last 1024 tokens: at long contexts a small
    # drafter's prefill of the whole prompt costs more than its drafts save, and the end kept
    # its acceptance (decode/RESULTS.md, drafter_context by context length)
    drafter_context: int | str = 1024
    # a drafter with its own tokenizer (decode/drafters/mapped.py): tli | text; read where the
    # mapped pair is loaded (decode/validate/mapped.py), not by DecoderConfig
    mapped_context: str = "tli"
    # model: prefills in the models' dtype, every logit the full-precision target's | bf16: a
    # long prompt's prefill under bf16 autocast (decode/RESULTS.md), both sides of a speedup alike
    prefill_dtype: str = "model"

    @classmethod
    def from_node(cls, node: Any, field: str = "decoder") -> DecoderSettings:
        """The node (DictConfig or mapping) as checked settings; a missing key takes the
        default. Every bad value is one ConfigError naming `field.<key>`, as the CLI spells it."""
        if not isinstance(node, Mapping):
            raise ConfigError(f"{field}={node!r} must be a mapping of decoder settings")
        defaults = cls()

        def get(key: str) -> Any:
            value = node.get(key)
            return getattr(defaults, key) if value is None and key != "mask_token_id" else value

        settings = cls(
            gamma=_gamma(node.get("gamma", DEFAULT_GAMMA), field),
            max_gamma=get("max_gamma"),
            sampling=Sampling.from_parent(
                node if "sampling" in node else {**node, "sampling": {}}, f"{field}.sampling"
            ),
            lenience=number_as_float(get("lenience")),
            cache=str(get("cache")),
            compile=get("compile"),
            record_probs=bool(get("record_probs")),
            host_sync_every=get("host_sync_every"),
            cpu_matmul=str(get("cpu_matmul")),
            lean_steps=get("lean_steps"),
            draft_length=str(get("draft_length")),
            max_draft=get("max_draft"),
            draft_scope=str(get("draft_scope")),
            draft_floor=get("draft_floor"),
            probe_every=get("probe_every"),
            draft_costs=_draft_costs(node.get("draft_costs", "auto"), field),
            verify_costs=str(get("verify_costs")),
            drafting=str(get("drafting")),
            mask_token_id=node.get("mask_token_id"),
            draft_vocab=str(get("draft_vocab")),
            lookup=_lookup(get("lookup"), field),
            drafter_context=check_drafter_context(
                get("drafter_context"), f"{field}.drafter_context"
            ),
            mapped_context=check_context(get("mapped_context")),
            prefill_dtype=str(get("prefill_dtype")),
        )
        return settings.check(field)

    def check(self, field: str = "decoder") -> DecoderSettings:
        """These settings, or a ConfigError naming the field (the decoder's own checks, on a
        DecoderConfig at this gamma or, for auto, at 1)."""
        if self.gamma is None and (
            isinstance(self.max_gamma, bool)
            or not isinstance(self.max_gamma, int)
            or self.max_gamma < 1
        ):
            raise ConfigError(f"{field}.max_gamma={self.max_gamma!r} must be >= 1 for gamma=auto")
        check_decoder_config(self.decoder_config(1, (), self.gamma or 1))
        return self

    @property
    def gamma_or_default(self) -> int:
        """The fixed gamma, or DEFAULT_GAMMA where gamma is auto (a pilot's or a probe's)."""
        return DEFAULT_GAMMA if self.gamma is None else self.gamma

    def replace(self, **changes: Any) -> DecoderSettings:
        """A copy with `changes` (e.g. another sampling spec, a step mode), unchecked here: the
        decoder checks its DecoderConfig when it is built."""
        return dataclasses.replace(self, **changes)

    def decoder_config(
        self, max_new_tokens: int, eos: tuple[int, ...], gamma: int | None = None
    ) -> DecoderConfig:
        """The DecoderConfig of one decoder: these settings at `gamma` (default: the fixed
        gamma; gamma=auto needs the caller's resolved one)."""
        g = self.gamma if gamma is None else gamma
        if g is None:
            raise ValueError("gamma=auto: pass the resolved gamma")
        shared = {key: getattr(self, key) for key in _SHARED}
        if shared["lookup"] == "auto":
            shared["lookup"] = self.sampling.greedy
        return DecoderConfig(gamma=g, max_new_tokens=max_new_tokens, eos_token_id=eos, **shared)


def _lookup(raw: Any, field: str) -> bool | str:
    """true, false or auto (greedy only), or a ConfigError naming `field.lookup`."""
    if raw is True or raw is False or raw == "auto":
        return raw
    raise ConfigError(f"{field}.lookup={raw!r}: use auto (greedy only), true or false")


def _gamma(raw: Any, field: str) -> int | None:
    """`auto` -> None; otherwise an integer >= 1, or a ConfigError naming `field.gamma`."""
    if raw == "auto":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(f"{field}.gamma={raw!r} must be an integer >= 1 or `auto`")
    return raw


def _draft_costs(raw: Any, field: str) -> DraftCosts | None:
    """`auto` (or null) -> None: measured on the pair; else a mapping of DraftCosts' fields
    ({c, verify_per_token, round_overhead, draft_per_token (parallel drafting), glue_per_draft,
    prefill_per_token, prefill_fixed, verify_tokens (a list: what 1, 2, ... drafts add to the
    verify, as a report's draft_costs prints it)})."""
    if raw in (None, "auto"):
        return None
    try:
        return costs_from_mapping(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{field}.draft_costs={raw!r}: auto, or a mapping of c, verify_per_token, "
            f"draft_per_token, round_overhead, glue_per_draft, prefill_per_token, prefill_fixed "
            f"and optionally verify_tokens ({e})"
        ) from None


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
