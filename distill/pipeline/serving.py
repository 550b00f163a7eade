"""How the drafter will be served, and what that means for every stage of the pipeline.

The best recipe depends on the serving mode (DistillSpec; on the toy pair greedy Seq-KD + FKL
triples greedy acceptance but barely moves sampled acceptance, on-policy TVD does the reverse).
The pipeline's `serving` group (greedy | sampling, with temperature / top_p / top_k) and its
`recipe` group (defaulting to the shipped recipe of that mode) become each stage's overrides:

- generate: Seq-KD greedy or sampled (recipe.seqkd);
- distill: loss, beta, loss temperature, lmbda, on-policy temperature, and the held-out metric that picks best/:
  expected acceptance in the serving mode on the target's own continuations;
- validate (and online): the decoder in the serving mode, the other mode reported beside it.

User overrides under a stage's key (`distill.lmbda=0.5`) still win: they come after these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.decode.acceptance import Sampling
from specdistill.distill.losses import DIVERGENCES

MODES = ("greedy", "sampling")
SEQKD = ("greedy", "sampled")


@dataclass(frozen=True)
class Serving:
    """The serving setting; `sampling` is what the decoder applies to both p and q."""

    mode: str
    temperature: float
    top_p: float
    top_k: int
    report_temperature: float  # the sampling side reported beside greedy serving

    @property
    def sampling(self) -> Sampling:
        if self.mode == "greedy":
            return Sampling()
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def _plain(node: Any) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node or {})


def check_serving(node: Any) -> Serving:
    """The `serving` config as a Serving, or a ConfigError naming the field and the fix."""
    s = _plain(node)
    mode = s.get("mode")
    if mode not in MODES:
        raise ConfigError(f"serving.mode={mode!r}: use serving=greedy or serving=sampling")
    t = float(s.get("temperature") or 0.0)
    if mode == "sampling" and t <= 0:
        raise ConfigError(
            f"serving.temperature={t} with serving=sampling must be > 0 (greedy: serving=greedy)"
        )
    if mode == "greedy" and t != 0:
        raise ConfigError(
            f"serving.temperature={t} with serving=greedy: greedy ignores temperature; "
            f"use serving=sampling serving.temperature={t}"
        )
    top_p = float(s.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"serving.top_p={top_p} must lie in (0, 1]")
    top_k = int(s.get("top_k") or 0)
    if top_k < 0:
        raise ConfigError(f"serving.top_k={top_k} must be >= 0 (0 = off)")
    report_t = float(s.get("report_temperature") or 1.0)
    if report_t <= 0:
        raise ConfigError(f"serving.report_temperature={report_t} must be > 0")
    return Serving(mode, t, top_p, top_k, report_t)


def check_recipe(node: Any) -> dict[str, Any]:
    """The `recipe` config, checked (plain dict)."""
    r = _plain(node)
    if r.get("seqkd") not in SEQKD:
        raise ConfigError(f"recipe.seqkd={r.get('seqkd')!r}: use greedy or sampled")
    if r.get("loss") not in DIVERGENCES:
        raise ConfigError(f"recipe.loss={r.get('loss')!r} is not one of {', '.join(DIVERGENCES)}")
    lmbda = r.get("lmbda")
    if lmbda is None or not 0.0 <= float(lmbda) <= 1.0:
        raise ConfigError(f"recipe.lmbda={lmbda} must lie in [0, 1]")
    beta = r.get("beta")
    if beta is not None and not 0.0 <= float(beta) <= 1.0:
        raise ConfigError(f"recipe.beta={beta} must lie in [0, 1] or be null")
    switch = r.get("switch") or {}
    if switch.get("at") is not None and not 0.0 < float(switch["at"]) < 1.0:
        raise ConfigError(f"recipe.switch.at={switch['at']} must lie in (0, 1)")
    if switch.get("loss") is not None and switch["loss"] not in DIVERGENCES:
        raise ConfigError(f"recipe.switch.loss={switch['loss']!r}: use {', '.join(DIVERGENCES)}")
    for key in ("onpolicy_temperature", "seqkd_temperature"):
        v = r.get(key, 1.0)
        if v != "serving" and (v is None or float(v) <= 0):
            raise ConfigError(f"recipe.{key}={v!r} must be > 0 or `serving`")
    return r


def _temperature(value: Any, serving: Serving) -> float:
    """A recipe temperature; `serving` means the serving temperature (1 for greedy serving)."""
    if value == "serving":
        return serving.temperature if serving.mode == "sampling" else 1.0
    return float(value)


def stage_overrides(serving: Serving, recipe: dict[str, Any]) -> dict[str, list[str]]:
    """Hydra overrides per stage (`generate`, `distill`, `validate`, `online`) for this
    serving mode and recipe. Pure: the pipeline composes each stage with them."""
    s = serving.sampling
    if recipe["seqkd"] == "greedy":
        generate = ["do_sample=false"]
    else:
        t = _temperature(recipe.get("seqkd_temperature", 1.0), serving)
        generate = ["do_sample=true", f"temperature={t}", f"top_p={s.top_p}", f"top_k={s.top_k}"]
    distill = [
        f"loss={recipe['loss']}",
        # sampling serving: p and q are compared at the serving temperature, as the decoder does
        f"loss.temperature={s.temperature if serving.mode == 'sampling' else 1.0}",
        f"lmbda={float(recipe['lmbda'])}",
        f"onpolicy.temperature={_temperature(recipe.get('onpolicy_temperature', 1.0), serving)}",
        "eval.source=target",
        f"eval.temperature={s.temperature}",
        f"eval.top_p={s.top_p}",
        f"eval.top_k={s.top_k}",
    ]
    if recipe.get("beta") is not None:
        distill.append(f"loss.beta={float(recipe['beta'])}")
    switch = recipe.get("switch") or {}
    if switch.get("at") is not None:  # a schedule: a second phase from at*max_steps on
        distill.append(f"switch.at={float(switch['at'])}")
        for key in ("loss", "beta", "lmbda"):
            if switch.get(key) is not None:
                distill.append(f"switch.{key}={switch[key]}")
    decoder = [
        f"decoder={serving.mode}",
        f"decoder.temperature={s.temperature}",
        f"decoder.top_p={s.top_p}",
        f"decoder.top_k={s.top_k}",
    ]
    validate = [
        *decoder,
        f"other_sampling.temperature={serving.report_temperature}",
        f"other_sampling.top_p={s.top_p}",
        f"other_sampling.top_k={s.top_k}",
    ]
    return {"generate": generate, "distill": distill, "validate": validate, "online": decoder}
