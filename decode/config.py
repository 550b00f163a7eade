"""The decoder's one config type and the checks that run before any decoding.

`DecoderConfig` is the `decoder` config node typed once and what one `SpeculativeDecoder` runs
with: every key of conf/decoder/*.yaml, plus what a stage adds (`decoder_config`). The keys'
defaults have one home, conf/decoder/greedy.yaml (each with why): the stages compose that file,
and the fields here take their defaults from it (`conf_values`), so a Python caller's
`DecoderConfig()` is the greedy preset with no value written twice
(tests/test_single_default.py). p = target, q = drafter. Every bad setting is one `ConfigError`
naming its config field, raised before weights are touched.
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
from specdistill.data.stage_config import conf_values, removed_message
from specdistill.decode.draft_length import POLICIES
from specdistill.decode.drafters import DRAFTING
from specdistill.decode.drafters.context import check_drafter_context
from specdistill.decode.drafters.mapped import check_context

_GREEDY = conf_values("decoder/greedy.yaml")  # every decoder key's default
DEFAULT_GAMMA: int = _GREEDY["gamma"]  # drafts per round (greedy.yaml says why)
MAX_DRAFT = 15  # most drafts a round may verify (the heuristic policy's ceiling)
# removed settings and why (a user's override gets this, not a typo hint)
REMOVED = {
    "cpu_matmul": "CPU kernels are no longer chosen by timing: steps run plain F.linear",
    "lean_steps": "decode steps run the model's own forward",
    "draft_floor": "the timed floor is gone: use draft_length=fixed, heuristic or confidence",
    "probe_every": "the timed floor is gone",
    "draft_scope": "every policy now lets each row verify its own drafts",
    "draft_costs": "draft lengths no longer read costs; validate.cost_model prices K",
    "verify_costs": "draft lengths no longer read costs; validate.cost_model prices K",
    "max_gamma": "gamma=auto is gone: validate recommends K from acceptance by position",
    "prefill_dtype": "prefills run in the model's dtype",
    "temperature": "it was replaced by the one sampling spec, decoder.sampling.temperature",
    "top_k": "it was replaced by the one sampling spec, decoder.sampling.top_k",
    "top_p": "it was replaced by the one sampling spec, decoder.sampling.top_p",
}


@dataclass(frozen=True)
class DecoderConfig:
    """How to decode (see conf/decoder/greedy.yaml for each key's meaning); `lenience` < 1 is
    DistillSpec's lossy rule (reported as lossy)."""

    gamma: int = DEFAULT_GAMMA
    # a stage's per-decode budget and the tokenizer's EOS ids: not config keys, so their
    # defaults are here (decoder_config sets both per decode)
    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=lambda: Sampling(**_GREEDY["sampling"]))
    lenience: float = _GREEDY["lenience"]
    eos_token_id: tuple[int, ...] = ()
    cache: str = _GREEDY["cache"]  # auto (static on CUDA, dynamic on CPU) | static | dynamic
    compile: str | bool = _GREEDY["compile"]  # auto: CUDA graphs on CUDA | true | false | drafter
    record_probs: bool = _GREEDY["record_probs"]  # the target's probabilities per position
    host_sync_every: int = _GREEDY["host_sync_every"]  # target-only: host sync every N; 0: auto
    draft_length: str = _GREEDY["draft_length"]  # fixed | heuristic | confidence
    max_draft: int = _GREEDY["max_draft"]  # heuristic: most drafts a round
    p_min: float = _GREEDY["p_min"]  # confidence: stop at a draft whose q top prob is below this
    drafting: str = _GREEDY["drafting"]  # autoregressive | parallel (PARD mask tokens)
    mask_token_id: int | None = _GREEDY["mask_token_id"]  # parallel: None reads the drafter's
    draft_vocab: str = _GREEDY["draft_vocab"]  # auto: the drafter's draft_vocab_ids | full
    lookup: bool = _GREEDY["lookup"]  # prompt lookup drafts at batch 1 (decode.lookup), opt-in
    drafter_context: int | str = _GREEDY["drafter_context"]  # auto | all | N last prompt tokens
    mapped_context: str = _GREEDY["mapped_context"]  # another tokenizer's drafter: tli | text

    @property
    def lossy(self) -> bool:
        return self.lenience != 1.0

    @property
    def most_drafts(self) -> int:
        """Most drafts a round of this config may verify."""
        return self.max_draft if self.draft_length == "heuristic" else self.gamma

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with `changes`, unchecked here: the decoder checks its config when built."""
        return dataclasses.replace(self, **changes)

    def decoder_config(
        self, max_new_tokens: int, eos: tuple[int, ...], gamma: int | None = None
    ) -> DecoderConfig:
        """This config for one decode: its token budget, EOS ids and (optionally) another gamma."""
        return self.replace(
            max_new_tokens=max_new_tokens,
            eos_token_id=tuple(eos),
            gamma=self.gamma if gamma is None else gamma,
        )

    @classmethod
    def from_node(cls, node: Any, field: str = "decoder") -> DecoderConfig:
        """The node (DictConfig or mapping) as checked settings; a missing or null key takes
        the default. Every bad value is one ConfigError naming `field.<key>`."""
        if not isinstance(node, Mapping):
            raise ConfigError(f"{field}={node!r} must be a mapping of decoder settings")
        names = {f.name for f in dataclasses.fields(cls)} - {"max_new_tokens", "eos_token_id"}
        for key in node:
            if key in REMOVED:
                raise ConfigError(removed_message(f"{field}.{key}", REMOVED[key]))
            if key not in names:
                raise ConfigError(
                    f"{field}.{key} is not a decoder setting; use one of {', '.join(sorted(names))}"
                )
        defaults = cls()
        values: dict[str, Any] = {}
        for key in names - {"sampling"}:
            raw = node.get(key)
            values[key] = getattr(defaults, key) if raw is None else raw
        values["mask_token_id"] = node.get("mask_token_id")
        values["sampling"] = Sampling.from_parent(
            node if "sampling" in node else {**node, "sampling": {}}, f"{field}.sampling"
        )
        values["lenience"] = number_as_float(values["lenience"])
        values["p_min"] = number_as_float(values["p_min"])
        for key in ("cache", "draft_length", "drafting", "draft_vocab", "mapped_context"):
            values[key] = str(values[key])
        values["drafter_context"] = check_drafter_context(
            values["drafter_context"], f"{field}.drafter_context"
        )
        values["mapped_context"] = check_context(values["mapped_context"])
        settings = cls(**values)
        check_decoder_config(settings, field)
        return settings


DecoderSettings = DecoderConfig  # the stages' name for the same type


def removed_keys(field: str = "decoder") -> dict[str, str]:
    """The decoder settings that were removed, as dotted keys under `field`, each with the line
    `from_node` refuses it with: the stages' command lines check the same table."""
    return {
        f"{field}.{key}": removed_message(f"{field}.{key}", why) for key, why in REMOVED.items()
    }


def _int_in(cfg: DecoderConfig, key: str, low: int, high: int, field: str) -> None:
    v = getattr(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ConfigError(f"{field}.{key}={v!r} must be an integer in {low}..{high}")


def check_decoder_config(cfg: DecoderConfig, field: str = "decoder") -> None:
    """Reject bad settings before any decoding, naming the config field."""
    if cfg.gamma == "auto":
        raise ConfigError(f"{field}.gamma=auto was removed: {REMOVED['max_gamma']}; set 1..15")
    _int_in(cfg, "gamma", 1, MAX_DRAFT, field)
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens!r} must be an integer >= 1")
    cfg.sampling.check(f"{field}.sampling")
    if not isinstance(cfg.lenience, int | float) or not 0.0 < cfg.lenience <= 1.0:
        raise ConfigError(f"{field}.lenience={cfg.lenience} must lie in (0, 1] (1 = lossless)")
    if cfg.cache not in ("auto", "static", "dynamic"):
        raise ConfigError(f"{field}.cache={cfg.cache!r}: use auto, static or dynamic")
    _int_in(cfg, "host_sync_every", 0, 1 << 20, field)
    if cfg.compile not in ("auto", True, False, "drafter"):
        raise ConfigError(f"{field}.compile={cfg.compile!r}: use auto, true, false or drafter")
    if cfg.draft_length not in POLICIES:
        raise ConfigError(f"{field}.draft_length={cfg.draft_length!r}: use {', '.join(POLICIES)}")
    _int_in(cfg, "max_draft", 1, MAX_DRAFT, field)
    if not isinstance(cfg.p_min, int | float) or not 0.0 <= cfg.p_min <= 1.0:
        raise ConfigError(f"{field}.p_min={cfg.p_min!r} must lie in [0, 1]")
    if not isinstance(cfg.lookup, bool):
        raise ConfigError(f"{field}.lookup={cfg.lookup!r} must be true or false")
    check_drafter_context(cfg.drafter_context)
    if cfg.drafting not in DRAFTING:
        raise ConfigError(f"{field}.drafting={cfg.drafting!r}: use {' or '.join(DRAFTING)}")
    if cfg.draft_vocab not in ("auto", "full"):
        raise ConfigError(
            f"{field}.draft_vocab={cfg.draft_vocab!r}: use auto (the drafter's config "
            "draft_vocab_ids when present) or full"
        )
    if cfg.compile is True and cfg.cache == "dynamic":
        raise ConfigError(
            f"{field}.compile=true compiles fixed-shape steps over a static cache: "
            f"set {field}.cache=static or auto"
        )


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


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
