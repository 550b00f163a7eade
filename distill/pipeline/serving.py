"""How the drafter will be served, and what that means for every stage of the pipeline.

The best recipe depends on the serving mode (DistillSpec; on the toy pair greedy Seq-KD + FKL
triples greedy acceptance but barely moves sampled acceptance, on-policy TVD does the reverse).
The pipeline's `serving` group (greedy | sampling, with `serving.sampling`, the one sampling spec
`{temperature, top_k, top_p}`) and its `recipe` group (defaulting to the shipped recipe of that
mode) become each stage's `StageOverrides` (distill/compose.py: group choices, and typed values
merged into the composed config), one spec per place that samples:

- generate: Seq-KD greedy, sampled or mixed (recipe.seqkd; mixed: `recipe.seqkd_share` of the
  prompts sampled, the rest greedy) -> `sampling`, `sampled_share`;
- distill: loss, beta, loss temperature, lmbda, the on-policy drafter's `onpolicy.sampling`, and
  the held-out metric that picks best/ (`eval.sampling`): expected acceptance in the serving mode
  on the target's own continuations; sampling serving trains the full head
  (`draft_vocab_train=false`: export/head.py pads a draft-vocabulary head, and sampled drafts
  in engines that run all of it can land on the padded rows);
- validate (and online): the decoder in the serving mode (`decoder.sampling`), the other mode
  reported beside it (`other_sampling`).

User overrides under a stage's key (`distill.lmbda=0.5`) still win: they are applied after these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError, required
from specdistill.data.sampling import Sampling
from specdistill.distill.compose import StageOverrides
from specdistill.distill.losses import DIVERGENCES

MODES = ("greedy", "sampling")
DRAFTING = ("autoregressive", "parallel")
SEQKD = ("greedy", "sampled", "mixed")


@dataclass(frozen=True)
class Serving:
    """The serving setting: `sampling` is what the decoder applies to both p and q; `report`
    is the sampling side validate reports beside greedy serving."""

    mode: str
    sampling: Sampling
    report: Sampling


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
    sampling = Sampling.from_parent(s, "serving.sampling")
    t = sampling.temperature
    if mode == "sampling" and sampling.greedy:
        raise ConfigError(
            f"serving.sampling.temperature={t} with serving=sampling must be > 0 "
            "(greedy: serving=greedy)"
        )
    if mode == "greedy" and not sampling.greedy:
        raise ConfigError(
            f"serving.sampling.temperature={t} with serving=greedy: greedy ignores temperature; "
            f"use serving=sampling serving.sampling.temperature={t}"
        )
    if mode == "greedy":  # top-k / top-p mean nothing at temperature 0
        sampling = Sampling()
    report = Sampling.from_node(
        s.get("report_sampling") or {"temperature": 1.0}, "serving.report_sampling"
    )
    if report.greedy:
        raise ConfigError(
            "serving.report_sampling.temperature=0: the side reported beside greedy samples; "
            "set it > 0 (e.g. 1.0)"
        )
    return Serving(mode, sampling, report)


def check_recipe(node: Any) -> dict[str, Any]:
    """The `recipe` config, checked (plain dict)."""
    r = _plain(node)
    if r.get("seqkd") not in SEQKD:
        raise ConfigError(f"recipe.seqkd={r.get('seqkd')!r}: use greedy, sampled or mixed")
    share = required(r, "seqkd_share", "recipe")
    if r["seqkd"] == "mixed" and (
        isinstance(share, bool)
        or not isinstance(share, (int, float))
        or not 0.0 < float(share) < 1.0
    ):
        raise ConfigError(
            f"recipe.seqkd_share={share!r} must lie in (0, 1) with recipe.seqkd=mixed: the "
            "share of prompts sampled, the rest greedy (e.g. 0.5)"
        )
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
        return serving.sampling.temperature if serving.mode == "sampling" else 1.0
    return float(value)


def stage_overrides(serving: Serving, recipe: dict[str, Any]) -> dict[str, StageOverrides]:
    """What this serving mode and recipe set into each stage (`generate`, `distill`,
    `validate`, `online`): group choices and typed values. Pure: the pipeline composes each
    stage with them."""
    s = serving.sampling
    generate: dict[str, Any] = {}
    if recipe["seqkd"] == "greedy":
        seqkd = Sampling()
    else:
        t = _temperature(required(recipe, "seqkd_temperature", "recipe"), serving)
        seqkd = Sampling(temperature=t, top_k=s.top_k, top_p=s.top_p)
        if recipe["seqkd"] == "mixed":
            generate["sampled_share"] = float(required(recipe, "seqkd_share", "recipe"))
    # The drafter samples its on-policy batches at the recipe's temperature, nothing cut.
    onpolicy = Sampling(
        temperature=_temperature(required(recipe, "onpolicy_temperature", "recipe"), serving)
    )
    distill: dict[str, Any] = {
        # sampling serving: p and q are compared at the serving temperature, as the decoder does
        "loss.temperature": s.temperature if serving.mode == "sampling" else 1.0,
        "lmbda": float(recipe["lmbda"]),
        "onpolicy.sampling": onpolicy.as_dict(),
        "eval.source": "target",
        "eval.sampling": s.as_dict(),
    }
    if serving.mode == "sampling":  # the full head: engines that run all of it (vLLM) sample
        distill["draft_vocab_train"] = False  # drafts from rows a draft-vocabulary run never trains
    if recipe.get("beta") is not None:
        distill["loss.beta"] = float(recipe["beta"])
    switch = recipe.get("switch") or {}
    if switch.get("at") is not None:  # a schedule: a second phase from at*max_steps on
        distill["switch.at"] = float(switch["at"])
        for key in ("loss", "beta", "lmbda"):
            if switch.get(key) is not None:
                distill[f"switch.{key}"] = switch[key]
    decoder = {"decoder.sampling": s.as_dict()}
    return {
        "generate": StageOverrides(values={"sampling": seqkd.as_dict(), **generate}),
        "distill": StageOverrides((f"loss={recipe['loss']}",), distill),
        "validate": StageOverrides(
            (f"decoder={serving.mode}",), {**decoder, "other_sampling": serving.report.as_dict()}
        ),
        "online": StageOverrides((f"decoder={serving.mode}",), decoder),
    }


def drafting_overrides(drafting: Any, stages: list[str]) -> dict[str, StageOverrides]:
    """Stage overrides for the pipeline's `drafting` (autoregressive | parallel, like the
    serving mode a setting of every stage): parallel trains a PARD drafter (distill
    `drafting=parallel`) and validates it with one drafter forward per round
    (`decoder.drafting=parallel`); export reads the mask token from the checkpoint."""
    if drafting not in DRAFTING:
        raise ConfigError(f"drafting={drafting!r}: use drafting=autoregressive or parallel")
    if drafting == "autoregressive":
        return {}
    if "online" in stages:
        raise ConfigError(
            "drafting=parallel with the online stage: online adaptation trains autoregressive "
            "drafts only; drop online from stages"
        )
    return {
        "distill": StageOverrides(values={"drafting": "parallel"}),
        "validate": StageOverrides(values={"decoder.drafting": "parallel"}),
    }
