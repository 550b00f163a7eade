"""The sections of conf/distill.yaml that are settings of their own (`loss`, `switch`,
`parallel`, `data`, `eval` with `eval.predict`, `onpolicy`), each typed and checked once by its
`from_node`; `TrainSettings.from_cfg` (train/settings.py) holds them. Every error is one line
naming the field. conf/distill.yaml is the one home of each key's default: the fields here have
none (tests/test_single_default.py), and a node built by hand without a key is one error too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from specdistill.data.runtime import ConfigError, number_as_float, required
from specdistill.data.sampling import Sampling
from specdistill.decode.config import MAX_DRAFT
from specdistill.decode.draft_length import costs_from_mapping
from specdistill.distill.losses import DIVERGENCES
from specdistill.distill.parallel import check_parallel_config


@dataclass(frozen=True)
class LossSettings:
    """`loss` (conf/loss/): the divergence, GKD's beta, the softmax temperature of p and q."""

    name: str
    beta: float
    temperature: float


@dataclass(frozen=True)
class SwitchSettings:
    """`switch`: an optional second phase from step int(at * max_steps) on (e.g. greedy Seq-KD +
    FKL, then on-policy TVD); None keeps the stage's own value. Checked only when `at` is set."""

    at: float | None
    loss: str | None
    beta: float | None
    lmbda: float | None

    @classmethod
    def from_node(cls, sw: Any) -> SwitchSettings:
        at, loss, beta, lmbda = (
            required(sw, key, "switch") for key in ("at", "loss", "beta", "lmbda")
        )
        if at is None:  # no second phase: its lmbda still counts in `most_onpolicy`
            return cls(None, None, None, _float_or_none(lmbda))
        if not 0.0 < float(at) < 1.0:
            raise ConfigError(
                f"switch.at={float(at)} must lie in (0, 1): the share of max_steps before it"
            )
        if loss is not None and loss not in DIVERGENCES:
            raise ConfigError(f"switch.loss={loss!r} is not one of {', '.join(DIVERGENCES)}")
        for key, v in (("lmbda", lmbda), ("beta", beta)):
            if v is not None and not 0.0 <= float(v) <= 1.0:
                raise ConfigError(f"switch.{key}={v} must lie in [0, 1] or be null")
        loss = None if loss is None else str(loss)
        return cls(float(at), loss, _float_or_none(beta), _float_or_none(lmbda))


@dataclass(frozen=True)
class ParallelSettings:
    """`parallel.*` (drafting=parallel only; distill/parallel.py checks them)."""

    depth: int
    anchors: int
    decay: float
    objective: str  # token | cat | acceptance_length
    length_weight: float
    cat_mix: float  # cat / acceptance_length: the share of the cat weights (rest: token)
    miss_weight: float  # contexts just after a drafter miss, where rounds start
    mask_token_id: int | str | None  # auto: the tokenizer's pad id

    @classmethod
    def from_node(cls, node: Any) -> ParallelSettings:
        check_parallel_config(node)
        return cls(
            depth=int(node.depth),
            anchors=int(node.anchors),
            decay=float(node.decay),
            objective=str(required(node, "objective", "parallel")),
            length_weight=float(required(node, "length_weight", "parallel")),
            cat_mix=float(required(node, "cat_mix", "parallel")),
            miss_weight=float(required(node, "miss_weight", "parallel")),
            mask_token_id=required(node, "mask_token_id", "parallel"),
        )


@dataclass(frozen=True)
class DataSettings:
    """`data`: the training rows' sources (values as given: paths and limits go to data/)."""

    path: Any  # a generate-stage (Seq-KD) dataset, or a list of them (read in turn)
    seq_kd: bool  # build one with the generate stage when path is null
    reference: bool
    use_topk: Any  # auto | true | false
    limit: Any
    generate: dict[str, Any]  # the generate stage's overrides

    @property
    def paths(self) -> tuple[str, ...]:
        """`path` as a tuple of folders (none when null)."""
        if self.path is None:
            return ()
        return tuple(self.path) if isinstance(self.path, tuple) else (self.path,)

    @classmethod
    def from_node(cls, node: Any) -> DataSettings:
        gen = required(node, "generate", "data")
        path = required(node, "path", "data")
        if isinstance(path, ListConfig | list | tuple):  # several Seq-KD sets (chat modes)
            if not path or not all(isinstance(p, str) and p for p in path):
                raise ConfigError(
                    f"data.path={list(path)!r} must be a folder or a non-empty list of folders"
                )
            path = tuple(str(p) for p in path)
        return cls(
            path=path,
            seq_kd=bool(required(node, "seq_kd", "data")),
            reference=bool(required(node, "reference", "data")),
            use_topk=required(node, "use_topk", "data"),
            limit=required(node, "limit", "data"),
            generate=OmegaConf.to_container(gen, resolve=True) if gen is not None else {},  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class PredictSettings:
    """`eval.predict`: best/'s decode figures replayed over the held-out set (train/predict.py).
    `costs`: null (the cost model's defaults, re-priced in the summary with validate's measured
    c and verify cost) or a mapping {c, verify_per_token}; nothing is timed."""

    enabled: bool
    gamma: int
    max_draft: int
    p_min: float
    costs: dict[str, Any] | None

    @classmethod
    def from_node(cls, node: Any) -> PredictSettings:
        costs = required(node, "costs", "eval.predict")
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
            enabled=bool(required(node, "enabled", "eval.predict")),
            gamma=required(node, "gamma", "eval.predict"),
            max_draft=required(node, "max_draft", "eval.predict"),
            p_min=number_as_float(required(node, "p_min", "eval.predict")),
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

    max_new_tokens: int
    sampling: Sampling
    engine: str  # transformers | vllm | auto (train/rollouts.py)

    @classmethod
    def from_node(cls, node: Any) -> OnpolicySettings:
        from specdistill.distill.train.rollouts import ENGINES

        sampling = Sampling.from_parent(node, "onpolicy.sampling")
        engine = str(required(node, "engine", "onpolicy"))
        if engine not in ENGINES:
            raise ConfigError(f"onpolicy.engine={engine!r}: choose one of {list(ENGINES)}")
        return cls(int(required(node, "max_new_tokens", "onpolicy")), sampling, engine)


@dataclass(frozen=True)
class EvalSettings:
    """`eval`: the held-out figure that picks best/ (acceptance in the serving mode)."""

    source: str  # reference | path | target
    path: Any
    split: Any
    limit: Any
    batch_size: int
    max_new_tokens: int
    topk_logprobs: int | str
    sampling: Sampling
    predict: PredictSettings

    @classmethod
    def from_node(cls, node: Any) -> EvalSettings:
        source = required(node, "source", "eval")
        if source not in ("reference", "path", "target"):
            raise ConfigError(f"eval.source={source!r}: use reference, path or target")
        sampling = Sampling.from_parent(node, "eval.sampling")
        k = required(node, "topk_logprobs", "eval")
        if k != "auto" and int(k) < 0:
            raise ConfigError(f"eval.topk_logprobs={k} must be >= 0 or auto")
        return cls(
            source=str(source),
            path=required(node, "path", "eval"),
            split=required(node, "split", "eval"),
            limit=required(node, "limit", "eval"),
            batch_size=int(required(node, "batch_size", "eval")),
            max_new_tokens=int(required(node, "max_new_tokens", "eval")),
            topk_logprobs=k if k == "auto" else int(k),
            sampling=sampling,
            predict=PredictSettings.from_node(required(node, "predict", "eval")),
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
