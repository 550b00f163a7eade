"""The whole pipeline: generate (Seq-KD) -> distill -> [online] -> validate -> export, on one pair.

Each stage composes its own primary config (`conf/<stage>.yaml`) with the pipeline's pair, the
run's folders and the overrides under the stage's key, and runs in-process. Stages hand off only
through paths (generate's output_dir is distill's `data.path`; distill's `drafter_path` is
validate's `pair.drafter` and export's `drafter`), so any one of them can also run alone or as a Slurm job. A stage
whose folder holds a completion marker for the same composed config is not run again, so a
killed pipeline restarted with the same command resumes at the first unfinished stage.
The run ends with `summary.md` + `report.png` (distill/pipeline/report.py) and the exported drafter
under `run_dir/export/drafter`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, read_json
from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.distill.pipeline.report import summarize, write_report
from specdistill.distill.pipeline.serving import check_recipe, check_serving, stage_overrides

log = logging.getLogger("specdistill.pipeline")

STAGES = ("generate", "distill", "online", "validate", "export")
DONE = ".stage_done.json"


@dataclass
class PipelineResult:
    run_dir: str
    stages: dict[str, dict] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def format_override(key: str, value: Any) -> str:
    """One Hydra command-line override, quoting strings the override grammar would misread."""
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, int | float):
        return f"{key}={value}"
    if isinstance(value, list | tuple):
        return f"{key}=[{','.join(format_override('x', v)[2:] for v in value)}]"
    if isinstance(value, dict):  # e.g. the items of online's `stream` list
        items = (f"{k}:{format_override('x', v)[2:]}" for k, v in value.items())
        return f"{key}={{{','.join(items)}}}"
    text = str(value)
    if text and all(c.isalnum() or c in "_-./" for c in text):
        return f"{key}={text}"
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"{key}='{escaped}'"


def flatten_overrides(node: Any, prefix: str = "") -> list[str]:
    """Nested stage overrides as dotted `key=value` strings (a bare string may pick a group)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    out: list[str] = []
    for key, value in (node or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(flatten_overrides(value, dotted + "."))
        else:
            out.append(format_override(dotted, value))
    return out


def compose_stage(stage: str, cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The stage's primary config with the pipeline's pair and the given overrides."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    user = flatten_overrides(cfg.get(stage) or {})

    def _compose() -> DictConfig:
        return compose(config_name=stage, overrides=[*overrides, *user])

    try:
        if GlobalHydra.instance().is_initialized():
            stage_cfg = _compose()
        else:
            with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
                stage_cfg = _compose()
    except Exception as e:  # hydra's errors name the bad key; add which section it came from
        raise ConfigError(
            f"{stage}: {e} (check the `{stage}:` section of the pipeline config)"
        ) from e
    OmegaConf.set_struct(stage_cfg, False)
    stage_cfg.pair = OmegaConf.merge(stage_cfg.pair, cfg.pair)
    return stage_cfg


def serving_overrides(cfg: DictConfig) -> dict[str, list[str]]:
    """Each stage's overrides from the `serving` mode and `recipe` (none when absent)."""
    if cfg.get("serving") is None:
        return {}
    if cfg.get("recipe") is None:
        raise ConfigError("serving is set but recipe is not: add `recipe: ${serving}` to defaults")
    return stage_overrides(check_serving(cfg.serving), check_recipe(cfg.recipe))


def _fingerprint(stage_cfg: DictConfig, after: str = "") -> str:
    text = OmegaConf.to_yaml(stage_cfg, resolve=True, sort_keys=True) + after
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stage_runner(stage: str) -> Callable[[DictConfig], Any]:
    if stage == "generate":
        from specdistill.data.generate.stage import run
    elif stage == "distill":
        from specdistill.distill.train.stage import run
    elif stage == "online":
        from specdistill.distill.online.stage import run
    elif stage == "validate":
        from specdistill.decode.validate.stage import run
    elif stage == "export":
        from specdistill.distill.export.stage import run
    else:
        raise ConfigError(f"stages contains {stage!r}; known stages are {', '.join(STAGES)}")
    return run


def run_stage(
    stage: str, stage_cfg: DictConfig, out_dir: Path, result_file: str, after: str = ""
) -> tuple[dict, str]:
    """Run one stage unless its folder says it already finished with this exact config.

    `after` is the fingerprint of the stage(s) whose output this one reads: a stage's own config
    names its input by path only, so without it a re-run upstream (say, more distill steps into
    the same folder) would leave validate and export skipped with stale results. Returns the
    stage's result and its fingerprint, which downstream stages pass on as their `after`.
    """
    marker = out_dir / DONE
    fp = _fingerprint(stage_cfg, after)
    if marker.exists() and read_json(marker).get("fingerprint") == fp:
        log.info("[%s] already done in %s; skipping", stage, out_dir)
        return read_json(out_dir / result_file), fp
    log.info("[%s] running -> %s", stage, out_dir)
    t0 = time.perf_counter()
    _stage_runner(stage)(stage_cfg)
    result = read_json(out_dir / result_file)
    atomic_write_json(marker, {"fingerprint": fp, "seconds": round(time.perf_counter() - t0, 1)})
    return result, fp


def run(cfg: DictConfig) -> PipelineResult:
    t0 = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    stages = list(cfg.stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages={stages}: unknown {unknown}; choose from {list(STAGES)}")
    result = PipelineResult(run_dir=str(run_dir))
    seed = f"seed={cfg.seed}"
    sv = serving_overrides(cfg)  # checked before any stage runs

    data_path: str | None = None
    drafter_path: str | None = None
    data_fp = drafter_fp = report_fp = ""  # fingerprints of what later stages read
    if "generate" in stages:  # generate_dir: one Seq-KD run shared by several runs (sweeps)
        out = Path(cfg.get("generate_dir") or run_dir / "generate")
        gcfg = compose_stage("generate", cfg, [*sv.get("generate", []), f"output_dir={out}", seed])
        result.stages["generate"], data_fp = run_stage("generate", gcfg, out, "result.json")
        data_path = str(out)
    if "distill" in stages:
        out = run_dir / "distill"
        extra = [*sv.get("distill", []), f"output_dir={out}", seed]
        if data_path:
            extra.append(format_override("data.path", data_path))
        dcfg = compose_stage("distill", cfg, extra)
        result.stages["distill"], drafter_fp = run_stage(
            "distill", dcfg, out, "result.json", after=data_fp
        )
        drafter_path = result.stages["distill"]["drafter_path"]
    if "online" in stages:  # adapt the (distilled) drafter on the stream; validate the result
        out = run_dir / "online"
        ocfg = compose_stage("online", cfg, [*sv.get("online", []), f"output_dir={out}", seed])
        if drafter_path:
            ocfg.pair.drafter = drafter_path
        result.stages["online"], drafter_fp = run_stage(
            "online", ocfg, out, "result.json", after=drafter_fp
        )
        drafter_path = result.stages["online"]["drafter_path"]
    if "validate" in stages:
        if drafter_path and cfg.get("validate_base", True):
            out = run_dir / "validate_base"
            vcfg = compose_stage(
                "validate", cfg, [*sv.get("validate", []), f"output_dir={out}", seed]
            )
            result.stages["validate_base"], _ = run_stage("validate", vcfg, out, "report.json")
        out = run_dir / "validate"
        vcfg = compose_stage("validate", cfg, [*sv.get("validate", []), f"output_dir={out}", seed])
        if drafter_path:
            vcfg.pair.drafter = drafter_path
        result.stages["validate"], report_fp = run_stage(
            "validate", vcfg, out, "report.json", after=drafter_fp
        )
        for name in cfg.get("validate_sets") or []:  # more prompt distributions, same drafter
            out = run_dir / f"validate_{name}"
            extra = [*sv.get("validate", []), f"dataset={name}", f"output_dir={out}", seed]
            vcfg = compose_stage("validate", cfg, extra)
            if drafter_path:
                vcfg.pair.drafter = drafter_path
            result.stages[f"validate_{name}"], _ = run_stage(
                "validate", vcfg, out, "report.json", after=drafter_fp
            )
    if "export" in stages:
        # The stage folder holds the marker; the shipped folder holds only the drafter.
        out = run_dir / "export"
        extra = [f"output_dir={out / 'drafter'}", "overwrite=true"]
        if drafter_path:
            extra.append(format_override("drafter", drafter_path))
        if "validate" in stages:
            extra.append(format_override("report", str(run_dir / "validate" / "report.json")))
        ecfg = compose_stage("export", cfg, extra)
        result.stages["export"], _ = run_stage(
            "export", ecfg, out, "drafter/export.json", after=drafter_fp + report_fp
        )

    result.summary = summarize(result.stages)
    serving = recipe = None
    if cfg.get("serving") is not None:
        serving = OmegaConf.to_container(cfg.serving, resolve=True)
        recipe = OmegaConf.to_container(cfg.recipe, resolve=True)
        result.summary["serving"], result.summary["recipe"] = serving, recipe
    result.wall_seconds = round(time.perf_counter() - t0, 1)
    atomic_write_json(run_dir / "pipeline.json", result)
    write_report(run_dir, result.stages, result.wall_seconds, serving, recipe)  # type: ignore[arg-type]
    return result


def summary_markdown(result: PipelineResult) -> str:
    """The console's end-of-run table (the same text as summary.md)."""
    from specdistill.distill.pipeline.report import summary_markdown as table

    s = result.summary
    return table(
        result.run_dir, result.stages, result.wall_seconds, s.get("serving"), s.get("recipe")
    )


@hydra.main(config_path="pkg://specdistill.conf", config_name="pipeline", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    result = run_or_exit(run, cfg)
    print(summary_markdown(result))
    print(json.dumps(result.summary, indent=2))


def stage_keys_addable(argv: list[str]) -> list[str]:
    """`distill.lmbda=0.5` on the command line as `++distill.lmbda=0.5`.

    The pipeline config's stage sections are open dicts: which keys a stage takes is its own
    config's business, checked when the stage is composed (an unknown key is an `error:` line
    naming the stage). Hydra's struct mode would refuse any key not already written in
    pipeline.yaml, so a stage override is a forced add; explicit `+`, `++` and `~` stay as given.
    """
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        if eq and "." in key and key.split(".", 1)[0] in STAGES:
            arg = f"++{arg}"
        out.append(arg)
    return out


def main() -> None:
    """Console script `specdistill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.argv[1:] = stage_keys_addable(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
