"""The one sampling spec: temperature, top-k, top-p, wherever sampling happens.

Every stage writes it with the same shape, `{temperature, top_k, top_p}`: `decoder.sampling`
(validate, online), the pipeline's `serving.sampling`, distill's `eval.sampling` and
`onpolicy.sampling`, generate's `sampling`, validate's `other_sampling`. `Sampling.from_node`
is the one parser; temperature 0 means greedy (argmax), and then top-k / top-p do nothing.

It lives on the ground floor so the decoder (`decode/acceptance.py` applies it to p and q alike)
and the generate stage share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from specdistill.data.runtime import ConfigError

KEYS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class Sampling:
    """Logits processing shared by target p and drafter q; temperature 0 means greedy (argmax).

    The fields' values are what off means (temperature 0: greedy; top_k 0 and top_p 1: no
    filter): the type's meaning, which code relies on when it builds greedy as `Sampling()`, not
    a stage's default. Every sampling node in conf/ states all three keys, so no stage key takes
    its value from here (tests/test_single_default.py)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, field: str) -> Sampling:
        """This spec, or a ConfigError naming `field.<key>` and the allowed range."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0:
            raise ConfigError(f"{field}.temperature={t!r} must be a number >= 0 (0 = greedy)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"{field}.top_k={k!r} must be an integer >= 0 (0 = off)")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ConfigError(f"{field}.top_p={p!r} must lie in (0, 1] (1 = off)")
        return self

    @classmethod
    def from_node(cls, node: Any, field: str) -> Sampling:
        """A `{temperature, top_k, top_p}` config node (DictConfig or mapping) as a checked
        Sampling; a missing key takes the default (greedy, no top-k, no top-p). Errors are one
        ConfigError naming `field` (e.g. `decoder.sampling.top_p=1.5 must lie in (0, 1]`)."""
        if not isinstance(node, Mapping):  # DictConfig is a Mapping too
            raise ConfigError(
                f"{field}={node!r} must be a mapping {{temperature, top_k, top_p}}, "
                f"e.g. {field}={{temperature:1.0,top_k:0,top_p:1.0}}"
            )
        values = dict(node.items())
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise ConfigError(
                f"{field} has unknown key(s) {', '.join(map(str, unknown))}: use {', '.join(KEYS)}"
            )
        t, k, p = (values.get(key) for key in KEYS)
        spec = cls(
            temperature=_number(t, cls.temperature),
            top_k=_integer(k, cls.top_k),
            top_p=_number(p, cls.top_p),
        )
        return spec.check(field)

    @classmethod
    def from_parent(cls, parent: Any, field: str) -> Sampling:
        """The spec at `field` (e.g. `decoder.sampling`) read from its parent node (the
        `decoder` node), refusing the per-key spelling beside it that the one spec replaced
        (`+decoder.temperature=0.7` would otherwise be silently ignored)."""
        key = field.rpartition(".")[2]
        for old, message in replaced_keys(field).items():
            if isinstance(parent, Mapping) and old.rpartition(".")[2] in parent:
                raise ConfigError(message)
        return cls.from_node(parent.get(key) if isinstance(parent, Mapping) else None, field)


def replaced_keys(field: str) -> dict[str, str]:
    """The per-key spellings beside the spec at `field` that it replaced (`eval.temperature`
    beside `eval.sampling`), each with its one-line refusal: read by `from_parent` and by the
    stages' command-line check (data/stage_config.py), so a removed key reads the same in both."""
    prefix = field.rpartition(".")[0]
    prefix = f"{prefix}." if prefix else ""
    out = {}
    for old in (*KEYS, "do_sample"):
        hint = (
            f"{field}.temperature=0 is greedy, > 0 samples"
            if old == "do_sample"
            else f"use {field}.{old}"
        )
        out[f"{prefix}{old}"] = f"{prefix}{old} was replaced by the one sampling spec: {hint}"
    return out


def _number(value: Any, default: float) -> Any:
    """A float for a number (ints too); anything else unchanged, for `check` to name."""
    if value is None:
        return default
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _integer(value: Any, default: int) -> Any:
    """An int for an integer (a whole float too, e.g. 40.0); anything else unchanged."""
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
