"""The sections of conf/distill.yaml that are settings of their own (`loss`, `switch`,
`parallel`, `data`, `eval` with `eval.predict`, `onpolicy`), each typed and checked once by its
`from_node`; `TrainSettings.from_cfg` (train/settings.py) holds them. Every error is one line
naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from specdistill.data.runtime import ConfigError, number_as_float, setting
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DEFAULT_GAMMA, MAX_DRAFT, DecoderConfig
from specdistill.decode.draft_length import costs_from_mapping
from specdistill.distill.losses import DIVERGENCES
from specdistill.distill.parallel import check_parallel_config


@dataclass(frozen=True)
class LossSettings:
    """`loss` (conf/loss/): the divergence, GKD's beta, the softmax temperature of p and q."""

    name: str = "fkl"
    beta: float = 0.0
    temperature: float = 1.0


@dataclass(frozen=True)
class SwitchSettings:
    """`switch`: an optional second phase from step int(at * max_steps) on (e.g. greedy Seq-KD +
    FKL, then on-policy TVD); None keeps the stage's own value. Checked only when `at` is set."""

    at: float | None = None
    loss: str | None = None
    beta: float | None = None
    lmbda: float | None = None

    @classmethod
    def from_node(cls, sw: Any) -> SwitchSettings:
        if sw is None:
            return cls()
        if sw.get("at") is None:  # no second phase: its lmbda still counts in `most_onpolicy`
            return cls(lmbda=_float_or_none(sw.get("lmbda")))
        at = float(sw.at)
        if not 0.0 < at < 1.0:
            raise ConfigError(
                f"switch.at={at} must lie in (0, 1): the share of max_steps before it"
            )
        if sw.get("loss") is not None and sw.loss not in DIVERGENCES:
            raise ConfigError(f"switch.loss={sw.loss!r} is not one of {', '.join(DIVERGENCES)}")
        for key in ("lmbda", "beta"):
            v = sw.get(key)
            if v is not None and not 0.0 <= float(v) <= 1.0:
                raise ConfigError(f"switch.{key}={v} must lie in [0, 1] or be null")
        loss = None if sw.get("loss") is None else str(sw.loss)
        return cls(at, loss, _float_or_none(sw.get("beta")), _float_or_none(sw.get("lmbda")))


@dataclass(frozen=True)
class ParallelSettings:
    """`parallel.*` (drafting=parallel only; distill/parallel.py checks them)."""

    depth: int = 8
    anchors: int = 16
    decay: float = 0.8
    objective: str = "token"  # token | cat | acceptance_length
    length_weight: float = 1.0
    cat_mix: float = 1.0  # cat / acceptance_length: the share of the cat weights (rest: token)
    miss_weight: float = 1.0  # contexts just after a drafter miss, where rounds start
    mask_token_id: int | str | None = "auto"  # auto: the tokenizer's pad id

    @classmethod
    def from_node(cls, node: Any) -> ParallelSettings:
        check_parallel_config(node)
        return cls(
            depth=int(node.depth),
            anchors=int(node.anchors),
            decay=float(node.decay),
            objective=str(setting(node, cls, "objective")),
            length_weight=float(setting(node, cls, "length_weight")),
            cat_mix=float(setting(node, cls, "cat_mix")),
            miss_weight=float(setting(node, cls, "miss_weight")),
            mask_token_id=setting(node, cls, "mask_token_id"),
        )


@dataclass(frozen=True)
class DataSettings:
    """`data`: the training rows' sources (values as given: paths and limits go to data/)."""

    path: Any = None  # a generate-stage (Seq-KD) dataset, or a list of them (read in turn)
    seq_kd: bool = True  # build one with the generate stage when path is null
    reference: bool = False
    use_topk: Any = "auto"  # auto | true | false
    limit: Any = None
    generate: dict[str, Any] = field(default_factory=dict)  # the generate stage's overrides

    @property
    def paths(self) -> tuple[str, ...]:
        """`path` as a tuple of folders (none when null)."""
        if self.path is None:
            return ()
        return tuple(self.path) if isinstance(self.path, tuple) else (self.path,)

    @classmethod
    def from_node(cls, node: Any) -> DataSettings:
        gen = node.get("generate")
        path = setting(node, cls, "path")
        if isinstance(path, ListConfig | list | tuple):  # several Seq-KD sets (chat modes)
            if not path or not all(isinstance(p, str) and p for p in path):
                raise ConfigError(
                    f"data.path={list(path)!r} must be a folder or a non-empty list of folders"
                )
            path = tuple(str(p) for p in path)
        return cls(
            path=path,
            seq_kd=bool(setting(node, cls, "seq_kd")),
            reference=bool(setting(node, cls, "reference")),
            use_topk=setting(node, cls, "use_topk"),
            limit=setting(node, cls, "limit"),
            generate=OmegaConf.to_container(gen, resolve=True) if gen is not None else {},  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class PredictSettings:
    """`eval.predict`: best/'s decode figures replayed over the held-out set (train/predict.py).
    `costs`: null (the cost model's defaults, re-priced in the summary with validate's measured
    c and verify cost) or a mapping {c, verify_per_token}; nothing is timed."""

    enabled: bool = True
    gamma: int = DEFAULT_GAMMA
    max_draft: int = 8
    p_min: float = DecoderConfig.p_min
    costs: dict[str, Any] | None = None

    @classmethod
    def from_node(cls, node: Any) -> PredictSettings:
        node = node or {}
        costs = node.get("costs", cls.costs)
        if isinstance(costs, DictConfig):
            costs = OmegaConf.to_container(costs, resolve=True)
        if costs == "auto":
            raise ConfigError(
                "eval.predict.costs=auto was removed: step costs are no longer timed; set null "
                "(default costs, priced with validate's measured ones in the summary) or "
                "{c, verify_per_token}"
            )
        if costs is not None:
            if not isinstance(costs, Mapping):
                raise ConfigError(
                    f"eval.predict.costs={costs!r}: use null or {{c, verify_per_token}}"
                )
            try:
                costs_from_mapping(costs)
            except ValueError as err:
                raise ConfigError(f"eval.predict.costs: {err}") from None
            costs = dict(costs)
        out = cls(
            enabled=bool(node.get("enabled", cls.enabled)),
            gamma=node.get("gamma", cls.gamma),
            max_draft=node.get("max_draft", cls.max_draft),
            p_min=number_as_float(node.get("p_min", cls.p_min)),
            costs=costs,
        )
        for key in ("gamma", "max_draft"):
            v = getattr(out, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DRAFT:
                raise ConfigError(f"eval.predict.{key}={v!r} must be an integer in 1..{MAX_DRAFT}")
        if not isinstance(out.p_min, float) or not 0.0 <= out.p_min <= 1.0:
            raise ConfigError(f"eval.predict.p_min={out.p_min!r} must lie in [0, 1]")
        return out


@dataclass(frozen=True)
class OnpolicySettings:
    """`onpolicy`: the drafter's own completions (lmbda > 0)."""

    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))
    engine: str = "auto"  # transformers | vllm | auto (train/rollouts.py)

    @classmethod
    def from_node(cls, node: Any) -> OnpolicySettings:
        from specdistill.distill.train.rollouts import ENGINES

        sampling = Sampling.from_parent(node, "onpolicy.sampling")
        engine = str(setting(node, cls, "engine"))
        if engine not in ENGINES:
            raise ConfigError(f"onpolicy.engine={engine!r}: choose one of {list(ENGINES)}")
        return cls(int(setting(node, cls, "max_new_tokens")), sampling, engine)


@dataclass(frozen=True)
class EvalSettings:
    """`eval`: the held-out figure that picks best/ (acceptance in the serving mode)."""

    source: str = "reference"  # reference | path | target
    path: Any = None
    split: Any = "test"
    limit: Any = 64
    batch_size: int = 16
    max_new_tokens: int = 64
    topk_logprobs: int | str = "auto"
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))
    predict: PredictSettings = field(default_factory=PredictSettings)

    @classmethod
    def from_node(cls, node: Any) -> EvalSettings:
        source = setting(node, cls, "source")
        if source not in ("reference", "path", "target"):
            raise ConfigError(f"eval.source={source!r}: use reference, path or target")
        sampling = Sampling.from_parent(node, "eval.sampling")
        k = setting(node, cls, "topk_logprobs")
        if k != "auto" and int(k) < 0:
            raise ConfigError(f"eval.topk_logprobs={k} must be >= 0 or auto")
        return cls(
            source=str(source),
            path=setting(node, cls, "path"),
            split=setting(node, cls, "split"),
            limit=setting(node, cls, "limit"),
            batch_size=int(setting(node, cls, "batch_size")),
            max_new_tokens=int(setting(node, cls, "max_new_tokens")),
            topk_logprobs=k if k == "auto" else int(k),
            sampling=sampling,
            predict=PredictSettings.from_node(node.get("predict")),
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
