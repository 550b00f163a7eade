"""The validate stage's config typed once: `ValidateSettings.from_cfg(cfg)` at the top of `run`.

conf/validate.yaml lists the values users see; the defaults of a key a caller's config lacks, and
every check of the stage's own settings, live here, so the stage and the decoder benchmark
(decode/bench/, which runs on the same config) read typed fields instead of parsing nodes again.
What needs the machine or the files (device, dtype, threads, the pair, the dataset, vLLM's
engine settings) is checked by `setup`, still before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.prompts import check_long_prompts
from specdistill.data.runtime import ConfigError, setting
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DecoderSettings
from specdistill.decode.validate.modes import both_modes, other_decoder
from specdistill.decode.validate.vllm_engine import draft_sample_method, parse_engines

PREFILL_ONCE = ("auto", "true", "false")
_POSITIVE = ("max_new_tokens", "repeats", "batch_size", "step_time_iters")


@dataclass(frozen=True)
class ValidateSettings:
    """The validate stage's settings (conf/validate.yaml) and its two decoders' settings.

    `decoder` is the serving mode's decoder; `other` the other serving mode's (greedy <->
    sampling at `other_sampling`), None when `both_modes` is off.
    """

    output_dir: Path
    decoder: DecoderSettings
    other: DecoderSettings | None
    max_new_tokens: int = 64
    num_prompts: int | None = 32  # None (or 0): every prompt of the split
    max_prompt_tokens: int | None = None  # None: the context left after max_new_tokens, gamma
    long_prompts: str = "truncate"
    batch_size: int = 1
    repeats: int = 1
    step_time_iters: int = 20
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: Any = "default"  # default (torch's: every core) | auto (1) | N (set_threads checks it)
    prefill_threads: Any = "auto"  # a prompt's prefill: auto (every core) | default | N
    hf_assisted: bool = True
    plot: bool = True
    progress: bool = True  # a bar over the timed decodes (stderr)
    prefill_once: str = "auto"  # auto (long prompt sets) | true | false: decode.prefill_memo
    engines: tuple[str, ...] = ("ours",)
    vllm_draft_sample_method: str | None = None  # engines=[ours,vllm]: vllm.draft_sample_method

    @property
    def both_modes(self) -> bool:
        return self.other is not None

    @property
    def samplings(self) -> list[Sampling]:
        """The serving mode's sampling spec, then the other mode's (when measured)."""
        return [d.sampling for d in (self.decoder, self.other) if d is not None]

    @classmethod
    def from_cfg(cls, cfg: Any) -> ValidateSettings:
        """The stage's config (DictConfig) checked and typed; a ConfigError names the field."""
        decoder = DecoderSettings.from_node(cfg.decoder, "decoder")
        for key in _POSITIVE:
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        long_prompts = setting(cfg, cls, "long_prompts")
        check_long_prompts(long_prompts)
        engines = parse_engines(cfg)
        if "vllm" in engines and decoder.lookup == "auto":
            # both engines on one footing: vLLM runs the drafter alone, so ours does too unless
            # asked (decoder.lookup=true); their acceptance is compared position by position
            decoder = decoder.replace(lookup=False)
        other = other_decoder(decoder, cfg.get("other_sampling")) if both_modes(cfg) else None
        prefill_once = str(setting(cfg, cls, "prefill_once")).lower()
        if prefill_once not in PREFILL_ONCE:
            raise ConfigError(
                f"prefill_once={prefill_once!r} is not known; use one of {', '.join(PREFILL_ONCE)}"
            )
        method = draft_sample_method(cfg.vllm) if "vllm" in engines else None
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            decoder=decoder,
            other=other,
            max_new_tokens=int(cfg.max_new_tokens),
            num_prompts=int(cfg.num_prompts) if cfg.get("num_prompts") else None,  # 0/null: all
            max_prompt_tokens=cfg.get("max_prompt_tokens") or None,
            long_prompts=str(long_prompts),
            batch_size=int(cfg.batch_size),
            repeats=int(cfg.repeats),
            step_time_iters=int(cfg.step_time_iters),
            seed=int(setting(cfg, cls, "seed")),
            device=str(setting(cfg, cls, "device")),
            dtype=str(setting(cfg, cls, "dtype")),
            threads=setting(cfg, cls, "threads"),
            prefill_threads=setting(cfg, cls, "prefill_threads"),
            hf_assisted=bool(setting(cfg, cls, "hf_assisted")),
            plot=bool(setting(cfg, cls, "plot")),
            progress=bool(setting(cfg, cls, "progress")),
            prefill_once=prefill_once,
            engines=engines,
            vllm_draft_sample_method=method,
        )

    def prefills_once(self, bucketed: bool) -> bool:
        """Whether decodes restore each prompt's prefill from its first run (`prefill_once`;
        auto: for bucketed, i.e. long-context, prompt sets, where prefills dominate a run)."""
        return self.prefill_once == "true" or (self.prefill_once == "auto" and bucketed)

    @property
    def gamma_room(self) -> int:
        """The most tokens one round may draft: the prompt budget leaves room for them."""
        d = self.decoder
        return max(d.max_gamma if d.gamma is None else d.gamma, d.max_draft)
