"""The validate stage's config typed once: `ValidateSettings.from_cfg(cfg)` at the top of `run`.

conf/validate.yaml is the one home of every key's default, with why (the fields here have none:
tests/test_single_default.py); the types and every check of the stage's own settings live here
(a config built by hand without a key is one `error:` line naming it), so the stage and the
decoder benchmark (decode/bench/, which runs on the same config) read typed fields instead of
parsing nodes again. Each engine's own node (`vllm.*`, `llamacpp.*`) is typed by that engine
(decode/validate/engines/) into `engine_settings`. What needs the machine or the files (device,
dtype, threads, the pair, the dataset, each engine's install) is checked by `setup`, still
before any weights load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import Container, OmegaConf

from specdistill.data.prompts import check_long_prompts
from specdistill.data.runtime import ConfigError, required
from specdistill.data.sampling import Sampling
from specdistill.data.stage_config import removed_message
from specdistill.decode.config import MAX_DRAFT, DecoderSettings
from specdistill.decode.config import removed_keys as removed_decoder_keys
from specdistill.decode.draft_length import DraftCosts, costs_from_mapping
from specdistill.decode.validate.engines import ENGINES, parse_engines
from specdistill.decode.validate.modes import both_modes, other_decoder

_POSITIVE = ("max_new_tokens", "repeats", "batch_size", "step_time_iters")
PREFILL_ONCE = removed_message("prefill_once", "every decode prefills its own prompt")


def removed_keys() -> dict[str, str]:
    """The stage's removed settings (dotted key -> its one-line refusal): `from_cfg` and the
    stage's command line (data/stage_config.py) refuse them alike."""
    return {**removed_decoder_keys("decoder"), "prefill_once": PREFILL_ONCE}


class CostModel(NamedTuple):
    """One `cost_model` entry: a user's hardware at a batch size, in target steps."""

    label: str
    batch: int
    costs: DraftCosts


@dataclass(frozen=True)
class ValidateSettings:
    """The validate stage's settings (conf/validate.yaml) and its two decoders' settings.

    `decoder` is the serving mode's decoder; `other` the other serving mode's (greedy <->
    sampling at `other_sampling`), None when `both_modes` is off.
    """

    output_dir: Path
    decoder: DecoderSettings
    other: DecoderSettings | None
    max_new_tokens: int
    num_prompts: int | None  # None (or 0): every prompt of the split
    max_prompt_tokens: int | None  # None: the context left after max_new_tokens, gamma
    long_prompts: str
    batch_size: int
    repeats: int
    step_time_iters: int
    seed: int
    device: str
    dtype: str
    threads: Any  # default (torch's: every core) | auto (1) | N (set_threads checks it)
    hf_assisted: bool
    plot: bool
    progress: bool  # a bar over the timed decodes (stderr)
    # the recommended K: acceptance by position up to this K (0: no recommendation), priced at
    # this machine's costs and at each `cost_model` entry's (a user's hardware, per batch size)
    recommend_max_k: int
    cost_model: tuple[CostModel, ...]
    engines: tuple[str, ...]
    # each chosen engine's own settings, typed by it (e.g. llamacpp: LlamaCppSettings), by name
    engine_settings: dict[str, Any]
    training_data: str | None  # a Seq-KD dataset: no prompt may be among its rows
    # a folder the run's validate steps share their target-only side through (target_only.py)
    target_only_cache: Path | None

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
            value = required(cfg, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        long_prompts = required(cfg, "long_prompts")
        check_long_prompts(long_prompts)
        engines = parse_engines(cfg)
        other = other_decoder(decoder, required(cfg, "other_sampling")) if both_modes(cfg) else None
        if cfg.get("prefill_once") is not None:
            raise ConfigError(PREFILL_ONCE)
        top = required(cfg, "recommend_max_k")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_DRAFT:
            raise ConfigError(f"recommend_max_k={top!r} must be an integer in 0..{MAX_DRAFT}")
        own = {name: ENGINES[name].settings(cfg) for name in engines}
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            decoder=decoder,
            other=other,
            max_new_tokens=int(cfg.max_new_tokens),
            num_prompts=int(cfg.num_prompts)
            if required(cfg, "num_prompts")
            else None,  # 0/null: all
            max_prompt_tokens=required(cfg, "max_prompt_tokens") or None,
            long_prompts=str(long_prompts),
            batch_size=int(cfg.batch_size),
            repeats=int(cfg.repeats),
            step_time_iters=int(cfg.step_time_iters),
            seed=int(required(cfg, "seed")),
            device=str(required(cfg, "device")),
            dtype=str(required(cfg, "dtype")),
            threads=required(cfg, "threads"),
            hf_assisted=bool(required(cfg, "hf_assisted")),
            plot=bool(required(cfg, "plot")),
            progress=bool(required(cfg, "progress")),
            recommend_max_k=top,
            cost_model=cost_models(required(cfg, "cost_model")),
            engines=engines,
            engine_settings=own,
            training_data=str(cfg.training_data) if required(cfg, "training_data") else None,
            target_only_cache=(
                Path(str(cfg.target_only_cache)).expanduser().absolute()
                if required(cfg, "target_only_cache")
                else None
            ),
        )

    @property
    def gamma_room(self) -> int:
        """The most tokens one round may draft: the prompt budget leaves room for them."""
        return max(self.decoder.most_drafts, self.recommend_max_k)


def cost_models(node: Any) -> tuple[CostModel, ...]:
    """`cost_model`: a list of {c, verify_per_token, draft_per_token, batch, label} (a user's
    hardware: one target step = 1), or null. One ConfigError naming `cost_model[i].key`."""
    if node is None:
        return ()
    if isinstance(node, Container):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, Mapping):
        node = [node]
    if isinstance(node, str) or not isinstance(node, Sequence):
        raise ConfigError(
            f"cost_model={node!r} must be a list of {{c: ..., verify_per_token: ...}} entries"
        )
    out = []
    for i, entry in enumerate(node):
        field = f"cost_model[{i}]"
        if not isinstance(entry, Mapping) or "c" not in entry:
            raise ConfigError(f"{field}={entry!r} needs c (a drafter step in target steps)")
        entry = dict(entry)
        label, batch = entry.pop("label", None), entry.pop("batch", 1)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"{field}.batch={batch!r} must be a positive integer")
        try:
            costs = costs_from_mapping(entry)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None
        out.append(CostModel(label or f"cost_model (batch {batch})", batch, costs))
    return tuple(out)
