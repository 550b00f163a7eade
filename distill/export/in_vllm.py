"""The exported drafter in the engine users deploy (`export vllm.enabled=true`).

Drafters that train fine and then fail to load or to speed up in vLLM are the common complaint,
and what vLLM loads is the exported folder (vocabulary rows padded to the target's, ids and
generation config aligned), not the distill checkpoint. So, before publishing, the export can
run the validate stage with `engines=[ours,vllm]` on the folder it is about to publish: on the
validate report's own settings (same prompts, gamma, modes, repeats) when one was given, else
validate's defaults on the export's pair. Its report (both engines side by side) is written to
`vllm.output_dir`; the model card and export.json carry vLLM's figures. p = target, q = drafter.
A drafter with its own tokenizer (a mapped export) runs there as TLI (`use_heterogeneous_vocab`:
greedy drafts only), so its run keeps vLLM's greedy draft sampling and our decoder's `tli`
context whatever the report's settings were: both engines then measure the same drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.generate.vllm_engine import require_vllm
from specdistill.data.models.pair_vocab import resolves_to_mapped
from specdistill.data.runtime import ConfigError, required
from specdistill.data.stage_config import config_module
from specdistill.decode.validate.stage import run as validate
from specdistill.distill.compose import compose_stage

ASKED_BY = "vllm.enabled=true"


def check_vllm_settings(cfg: DictConfig) -> bool:
    """Whether the export validates in vLLM; refuses early (before any model loads) when vLLM
    cannot be imported."""
    node = required(cfg, "vllm")
    if not required(node, "enabled", "vllm"):
        return False
    if not node.get("output_dir"):
        raise ConfigError("vllm.output_dir is empty: name the folder for the vLLM validate report")
    require_vllm(ASKED_BY)
    return True


def validate_config(cfg: DictConfig, report: dict[str, Any] | None, drafter: Path) -> DictConfig:
    """The validate stage's config for the exported folder: the report's settings when given."""
    overrides = [f"output_dir={cfg.vllm.output_dir}", "engines=[ours,vllm]", "plot=false"]
    if report and report.get("config"):
        vcfg = OmegaConf.create(report["config"])
        OmegaConf.set_struct(vcfg, False)
        vcfg.merge_with(OmegaConf.from_dotlist(overrides))
        vcfg.pair = OmegaConf.merge(vcfg.pair, cfg.pair)
    else:
        with config_module():
            vcfg = compose_stage("validate", OmegaConf.create({"pair": cfg.pair}), overrides)
    if vcfg.get("vllm") is None:  # a report from before engines=[ours,vllm]: validate's defaults
        with config_module():
            vcfg.vllm = compose_stage("validate", OmegaConf.create({"pair": cfg.pair}), []).vllm
    for key, value in (cfg.vllm.get("engine") or {}).items():
        if value is not None:
            vcfg.vllm[key] = value
    vcfg.pair.drafter = str(drafter)
    vcfg.pair.drafter_revision = None
    # vLLM drafts num_speculative_tokens every round: ours at the same fixed gamma, so the two
    # engines' per-position acceptance compares like for like (an adaptive policy's figures
    # stay in the validate report the export was given)
    vcfg.decoder.draft_length = "fixed"
    if resolves_to_mapped(vcfg.pair):  # TLI in vLLM: what validate accepts for a mapped pair
        vcfg.vllm.draft_sample_method = None
        vcfg.decoder.mapped_context = "tli"
    return vcfg


def validate_exported(
    cfg: DictConfig, report: dict[str, Any] | None, drafter: Path
) -> dict[str, Any]:
    """Run validate (ours and vLLM) on the folder about to be published; export.json's `vllm`."""
    result = validate(validate_config(cfg, report, drafter))
    v = result.vllm or {}
    return {
        "report": str(Path(result.output_dir) / "report.json"),
        "version": v.get("version"),
        "num_speculative_tokens": v.get("num_speculative_tokens"),
        "dtype": v.get("dtype"),
        "device": result.device,
        "prompts": result.prompts,
        "max_new_tokens": result.max_new_tokens,
        "repeats": result.repeats,
        "greedy_identical_to_plain": v.get("greedy_identical_to_plain"),
        "modes": {
            mode: {
                key: row.get(key)
                for key in (
                    "temperature",
                    "acceptance_rate",
                    "mean_acceptance_length",
                    "accepted_by_position",
                    "speedup",
                    "plain_tokens_per_s",
                    "speculative_tokens_per_s",
                    "engine_defect",
                )
            }
            | {
                "ours_acceptance_rate": (row.get("ours") or {}).get("acceptance_rate"),
                "ours_mean_acceptance_length": (row.get("ours") or {}).get(
                    "mean_acceptance_length"
                ),
                "ours_speedup": (row.get("ours") or {}).get("speedup"),
                "beyond_noise": (row.get("agreement") or {}).get("beyond_noise"),
            }
            for mode, row in (v.get("modes") or {}).items()
        },
        "notes": list(result.notes),
    }
