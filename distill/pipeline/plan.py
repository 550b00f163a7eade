"""The pipeline's plan: every step's stage config composed once, resolved, with its hand-offs.

`build_plan(cfg)` turns the pipeline config into a list of Steps (generate, distill, online,
validate_base, validate, validate_<set>, with `long_context.enabled` generate_long, distill_long,
validate_long_base, validate_long_short and validate_long, then export, report), in the order
they run. A Step holds its
stage's primary config (`conf/<stage>.yaml`) composed with the pipeline's pair, the serving
mode's and recipe's overrides (distill/pipeline/serving.py), the run's folders, the seed and the
user's `STAGE.KEY=VALUE` keys, resolved to a plain dict: exactly what the stage runs, wherever
it runs. Hand-offs are paths known up front (generate's output_dir is distill's `data.path`;
distill's drafter is `<run_dir>/distill/best`, online's `<run_dir>/online/drafter`), so the
fingerprint of a step (its config + the fingerprints of the steps whose output it reads) is
static too: a changed distill re-runs what reads its output, on any executor.

Executors: the local one runs the steps in-process (distill/pipeline/local.py), the Slurm one
submits one job per step (distill/pipeline/slurm.py); both call the same `run_step`
(pipeline/execute.py) on the same Step, and each step's file under `<run_dir>/plan/` is what its
job loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_text
from specdistill.data.runtime import ConfigError, required
from specdistill.data.stage_config import config_module
from specdistill.distill.compose import StageOverrides, compose_stage, whole_set
from specdistill.distill.export.hub import check_repo_id
from specdistill.distill.pipeline.category_report import COMPARED
from specdistill.distill.pipeline.chat_modes import chat_modes
from specdistill.distill.pipeline.heldout_plan import check_heldout_plan
from specdistill.distill.pipeline.mapped_pairs import check_mapped_plan
from specdistill.distill.pipeline.preflight_plan import check_preflight
from specdistill.distill.pipeline.serving import (
    check_recipe,
    check_serving,
    drafting_overrides,
    stage_overrides,
)
from specdistill.distill.pipeline.step_checks import check_steps

STAGES = ("generate", "distill", "online", "validate", "export")
MODULES = {  # each stage's own entry point: `python -m MODULE KEY=VALUE ...`
    "generate": "specdistill.data.generate",
    "distill": "specdistill.distill.train",
    "online": "specdistill.distill.online",
    "validate": "specdistill.decode.validate",
    "export": "specdistill.distill.export",
    "report": "specdistill.distill.pipeline.report",
}
RESULT_FILES = {  # relative to the step's out_dir
    "generate": "result.json",
    "distill": "result.json",
    "online": "result.json",
    "validate": "report.json",
    "export": "drafter/export.json",
    "report": "pipeline.json",
}
DATASET_STAGES = ("generate", "distill", "validate")  # the stages with a `dataset` group
PLAN_DIR = "plan"  # <run_dir>/plan/<step>.yaml: what each step's job loads


@dataclass
class Step:
    """One unit of work: a stage on its fully composed config, and the steps it reads from."""

    name: str  # generate, distill, online, validate_base, validate, validate_<set>, *_long*, export, report
    stage: str  # which stage runs it (validate_* steps run `validate`)
    module: str  # the stage's `python -m` entry point
    out_dir: str
    result_file: str  # relative to out_dir; read back when the stage returns
    needs: list[str] = field(default_factory=list)
    fingerprint: str = ""  # config + needed steps' fingerprints; "" = always runs (report)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def result_path(self) -> Path:
        return Path(self.out_dir) / self.result_file

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def serving_overrides(cfg: DictConfig) -> dict[str, StageOverrides]:
    """Each stage's overrides from the `serving` mode and `recipe` (none when absent), then the
    `drafting` mode's."""
    out: dict[str, StageOverrides] = {}
    if cfg.get("serving") is not None:
        if cfg.get("recipe") is None:
            raise ConfigError(
                "serving is set but recipe is not: add `recipe: ${serving}` to defaults"
            )
        out = stage_overrides(check_serving(cfg.serving), check_recipe(cfg.recipe))
    stages = list(cfg.get("stages") or [])
    for stage, extra in drafting_overrides(required(cfg, "drafting"), stages).items():
        out[stage] = out.get(stage, StageOverrides()) + extra
    return out


def fingerprint(config: dict[str, Any], after: str = "") -> str:
    """A step's identity: its resolved config and what it reads (`after`: upstream fingerprints)."""
    text = OmegaConf.to_yaml(OmegaConf.create(config), sort_keys=True) + after
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _resolved(stage_cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(stage_cfg, resolve=True)  # type: ignore[return-value]
    except Exception as e:  # an interpolation that cannot resolve: name it here, not in a job
        raise ConfigError(" ".join(str(e).split())) from e


@dataclass
class _Planner:
    """The steps composed so far and how a stage's config is composed (the pipeline config,
    each stage's serving-mode overrides, the seed)."""

    cfg: DictConfig
    overrides: dict[str, StageOverrides]  # serving_overrides(cfg)
    steps: list[Step] = field(default_factory=list)
    modes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # chat_modes.py
    mode_data: dict[str, Step] = field(default_factory=dict)  # each mode's generate step

    def add(self, name: str, stage: str, out: Path, stage_cfg: DictConfig, reads: list) -> Step:
        """A step on `stage_cfg` (resolved), reading the output of the steps in `reads`."""
        reads = [s for s in reads if s is not None]
        config = _resolved(stage_cfg)
        after = "".join(s.fingerprint for s in reads)
        step = Step(name, stage, MODULES[stage], str(out), RESULT_FILES[stage],
                    [s.name for s in reads], fingerprint(config, after), config)  # fmt: skip
        self.steps.append(step)
        return step

    def compose(self, stage: str, dataset: str | None = None, **values: Any) -> DictConfig:
        """The stage's config: the serving mode's overrides, then this step's values (its
        folders, hand-offs; dotted keys spelled with `__`), the seed; `dataset` picks a set."""
        cfg = self.cfg
        typed = {k.replace("__", "."): v for k, v in values.items()} | {"seed": cfg.seed}
        if stage == "validate" and required(cfg, "llamacpp"):  # the drafters in llama.cpp too
            typed.setdefault("engines", ["ours", "llamacpp"])
        own_groups = (f"dataset={dataset}",) if dataset else ()
        extra = StageOverrides(own_groups, typed)
        stage_cfg = compose_stage(stage, cfg, self.overrides.get(stage, StageOverrides()) + extra)
        own = (cfg.get(stage) or {}).get("dataset")
        whole = whole_set(cfg.get(stage)) is not None  # a sizing's pick, set by compose_stage
        picked = isinstance(own, str) or whole or dataset is not None
        if cfg.get("dataset") is not None and stage in DATASET_STAGES:
            keys = None if whole else own  # a whole set is no keys over a step's own pick
            stage_cfg.dataset = pipeline_dataset(cfg.dataset, stage_cfg.dataset, keys, picked)
        if (
            self.modes and stage in DATASET_STAGES
        ):  # the served chat mode; a mode's step sets its own
            stage_cfg.dataset.chat_template_kwargs = dict(self.modes[0][1])
        return stage_cfg

    def validate_steps(
        self, run_dir: Path, drafter_path: str | None, reads: list, data: Step | None = None
    ) -> Step:
        """validate_base (the undistilled drafter), validate and one validate_<set> per
        `validate_sets`; returns the validate step (its report goes into the export's card).
        With the run's own Seq-KD rows (`data`), each checks its prompts are none of them
        (validate.training_data) and so waits for generate. All share one target-only side
        (validate.target_only_cache): the first to run decodes it, the others reuse it."""
        held: dict[str, Any] = {"training_data": data.out_dir} if data else {}
        held["target_only_cache"] = _target_only(run_dir)
        if drafter_path and required(self.cfg, "validate_base"):
            out = run_dir / "validate_base"
            # an autoregressive base drafter: validated as one, whatever `drafting` is
            base = self.compose(
                "validate", output_dir=str(out), decoder__drafting="autoregressive", **held
            )
            self.add("validate_base", "validate", out, base, [data])
        for name, path in compare_drafters(self.cfg).items():  # other drafters, same prompts
            out = run_dir / f"{COMPARED}{name}"
            other = self.compose(
                "validate", output_dir=str(out), decoder__drafting="autoregressive", **held
            )
            other.pair.drafter = path
            self.add(out.name, "validate", out, other, [data])
        report = None
        for name in [None, *(self.cfg.get("validate_sets") or [])]:  # more prompt distributions
            out = run_dir / ("validate" if name is None else f"validate_{name}")
            vcfg = self.compose("validate", name, output_dir=str(out), **held)
            if drafter_path:
                vcfg.pair.drafter = drafter_path
            step = self.add(out.name, "validate", out, vcfg, [*reads, data])
            report = report or step
        for label, kwargs in self.modes[1:]:  # the drafter in each other chat mode
            out = run_dir / f"validate_{label}"
            mode_data = self.mode_data.get(label)
            own = {**held, "training_data": mode_data.out_dir} if mode_data else held
            vcfg = self.compose("validate", output_dir=str(out), **own)
            vcfg.dataset.chat_template_kwargs = dict(kwargs)
            if drafter_path:
                vcfg.pair.drafter = drafter_path
            self.add(out.name, "validate", out, vcfg, [*reads, mode_data])
        return report  # type: ignore[return-value]

    def compose_long(self, stage: str, dataset: str | None = None, **values: Any) -> DictConfig:
        """A long-context step's config (`long_context`): the stage's section of the pipeline
        config (its threads, top-k, decoder) under `long_context.<stage>`'s keys, with the long
        prompt set picked as a group. The section's own `dataset` keys stay out: they belong to
        the short set (a toy world's `toy:` key means nothing to a long set)."""
        section = OmegaConf.to_container(self.cfg.get(stage) or OmegaConf.create(), resolve=False)
        section.pop("dataset", None)  # type: ignore[union-attr]
        merged = OmegaConf.merge(section, self.cfg.long_context.get(stage) or {})
        cfg = self.cfg.copy()
        OmegaConf.set_struct(cfg, False)
        cfg[stage] = merged
        return _Planner(cfg, self.overrides, modes=self.modes).compose(stage, dataset, **values)

    def long_context_steps(
        self, run_dir: Path, drafter_path: str | None, drafter: Step | None
    ) -> None:
        """The long-context leg (`long_context.enabled`): Seq-KD rows after long prompts
        (generate_long), the run's drafter fine-tuned on them (distill_long; its `final/` is the
        long drafter: `best/` is picked on the short held-out rows, which a long fine-tune trades a
        little of), then the base, short-trained and long-trained drafters validated by
        context-length bucket on held-out long prompts, one validate step each (validate_long_base,
        _short, validate_long)."""
        lc = self.cfg.long_context
        name = str(lc.dataset)
        out = run_dir / "generate_long"
        gen = self.add("generate_long", "generate", out,
                       self.compose_long("generate", name, output_dir=str(out)), [])  # fmt: skip
        out = run_dir / "distill_long"
        dcfg = self.compose_long("distill", output_dir=str(out), data__path=gen.out_dir)
        if drafter_path:
            dcfg.pair.drafter = drafter_path  # fine-tune the run's drafter, not the base
        short_eval = _written_eval(drafter)
        if short_eval and dcfg.eval.source == "target":  # the same held-out rows, not re-run
            dcfg.eval.source, dcfg.eval.path = "path", short_eval
        long = self.add("distill_long", "distill", out, dcfg, [gen, drafter])
        if "validate" not in self.cfg.stages:
            return
        drafters = [("validate_long_base", None, None), ("validate_long", str(out / "final"), long)]
        if drafter_path:
            drafters.insert(1, ("validate_long_short", drafter_path, drafter))
        for step_name, path, reads in drafters:
            out = run_dir / step_name
            own = {} if path else {"decoder__drafting": "autoregressive"}  # as validate_base
            own["target_only_cache"] = _target_only(run_dir)
            vcfg = self.compose_long("validate", name, output_dir=str(out), **own)
            if path:
                vcfg.pair.drafter = path
            self.add(step_name, "validate", out, vcfg, [reads])

    def export_step(
        self, run_dir: Path, drafter_path: str | None, reads: list, report: Step | None
    ) -> None:
        """The export: the stage folder holds the marker; the shipped folder the drafter only."""
        out = run_dir / "export"
        values: dict[str, Any] = {"output_dir": str(out / "drafter"), "overwrite": True}
        if drafter_path:
            values["drafter"] = drafter_path
        if report:
            values["report"] = str(Path(report.result_path))
        if required(self.cfg, "vllm"):  # validate the exported folder in vLLM before publishing
            values["vllm.enabled"] = True
        if required(self.cfg, "llamacpp"):  # the drafter as GGUF files beside the checkpoint
            values["gguf.enabled"] = True
        # no serving keys, no seed: a copy
        ecfg = compose_stage("export", self.cfg, StageOverrides(values=values))
        try:  # a bad hub repo id is refused before generate, not after validate
            check_repo_id(ecfg.get("push_to_hub"))
        except ConfigError as e:
            raise ConfigError(f"export.{e}") from e
        self.add("export", "export", out, ecfg, [*reads, report])


def _target_only(run_dir: Path) -> str:
    """The folder every validate step of a run shares its target-only side through
    (decode/validate/target_only.py): one target, one set of target-only decodes."""
    return str(run_dir / "target_only")


def _written_eval(step: Step | None) -> str | None:
    """Where a distill step writes the target's held-out continuations (`eval.source=target`),
    so a later fine-tune reads them instead of running the target again; None otherwise."""
    if step is None or step.stage != "distill" or step.config["eval"]["source"] != "target":
        return None
    ev = step.config["eval"]
    return str(ev["path"] or Path(step.config["output_dir"]) / "eval_continuations")


def compare_drafters(cfg: DictConfig) -> dict[str, str]:
    """`compare_drafters: {name: DIR}`: other drafters of the target (a pair=smollm2 run's
    export beside a chat run's) validated on the run's validate prompts as step
    validate_drafter_<name>; checked here, in one line, before any step runs."""
    raw = cfg.get("compare_drafters") or {}
    if not hasattr(raw, "items"):
        raise ConfigError(
            f"compare_drafters={raw!r} must map names to drafter folders: {{code: DIR}}"
        )
    out = {}
    for name, path in raw.items():
        if not str(name).isidentifier() or name in ("base", "distilled"):
            raise ConfigError(
                f"compare_drafters.{name}: use a name that is an identifier other than base and "
                "distilled (it names the validate_drafter_<name> step)"
            )
        if not Path(str(path)).expanduser().is_dir():
            raise ConfigError(
                f"compare_drafters.{name}={path!r} is not a folder: point it at a drafter "
                "checkpoint (e.g. a pair=smollm2 run's export/drafter)"
            )
        out[str(name)] = str(Path(str(path)).expanduser().absolute())
    return out


def pipeline_dataset(dataset: DictConfig, composed: Any, own: Any, picked: bool) -> DictConfig:
    """A dataset stage's prompt set under the pipeline's `dataset` node, the stage's own keys
    (`generate.dataset.limit`, a pair's sizing) always last:

    - a whole set (the node names its `source`: `dataset=ultrachat`) replaces the set of a stage
      that picked none of its own;
    - keys without a source (`+dataset.chat_template_kwargs={...}`) go over the stage's set;
    - a stage that picked its own set (`validate.dataset: chat_bench`, a `validate_sets` name)
      keeps it, with the node's `chat_template_kwargs`: the target renders every prompt of a run
      with the same template arguments.

    Merged outside struct mode: a key the set lacks (conf/sizing/smollm2.yaml's `toy: toy`
    under a hub set) is the stage's own like any other, not an OmegaConf error. Interpolations
    stay unresolved, so they resolve in the stage's config. No prompt is read here: the plan
    stays pure."""
    node: dict[str, Any] = OmegaConf.to_container(dataset, resolve=False)  # type: ignore[assignment]
    if picked:
        if node.get("chat_template_kwargs") is None:
            return composed
        node = {"chat_template_kwargs": node["chat_template_kwargs"]}
    if picked or "source" not in node:
        node = OmegaConf.merge(OmegaConf.to_container(composed, resolve=False), node)
    own_keys = own if hasattr(own, "items") else {}  # a picked set's name is no key
    return OmegaConf.merge(OmegaConf.create(node), own_keys)  # type: ignore[return-value]


def _report_step(cfg: DictConfig, run_dir: Path, steps: list[Step]) -> Step:
    """The last step: summary.md / report.png / pipeline.json over every step's result."""
    serving = recipe = None
    if cfg.get("serving") is not None:
        serving = OmegaConf.to_container(cfg.serving, resolve=True)
        recipe = OmegaConf.to_container(cfg.recipe, resolve=True)
    results = {s.name: str(s.result_path) for s in steps}
    config = {"run_dir": str(run_dir), "serving": serving, "recipe": recipe, "results": results}
    return Step(
        "report", "report", MODULES["report"], str(run_dir), RESULT_FILES["report"],
        list(results), "", config,
    )  # fmt: skip


def build_plan(cfg: DictConfig) -> list[Step]:
    """The steps of `cfg.stages` in run order, each on its final config; nothing is loaded."""
    stages = list(cfg.stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages={stages}: unknown {unknown}; choose from {list(STAGES)}")
    run_dir = Path(str(cfg.run_dir)).expanduser().absolute()
    # checked before anything is composed
    plan = _Planner(cfg, serving_overrides(cfg), modes=chat_modes(cfg))
    with config_module():
        data = drafter = report = None  # the steps whose output later steps read
        drafter_path: str | None = None
        if "generate" in stages:  # generate_dir: one Seq-KD run shared by several runs (sweeps)
            out = Path(str(cfg.get("generate_dir") or run_dir / "generate")).expanduser().absolute()
            for label, kwargs in plan.modes:  # one Seq-KD set per chat mode, the served first
                mout = out.with_name(f"{out.name}_{label}")
                gcfg = plan.compose("generate", output_dir=str(mout))
                gcfg.dataset.chat_template_kwargs = dict(kwargs)
                plan.mode_data[label] = plan.add(f"generate_{label}", "generate", mout, gcfg, [])
            if not plan.modes:
                gcfg = plan.compose("generate", output_dir=str(out))
                data = plan.add("generate", "generate", out, gcfg, [])
            data = data or plan.mode_data[plan.modes[0][0]]
        if "distill" in stages:
            out = run_dir / "distill"
            sets = list(plan.mode_data.values()) or [data]
            hand_off = {}
            if data:  # several chat modes: every mode's rows
                paths = [s.out_dir for s in sets]
                hand_off["data__path"] = paths if len(paths) > 1 else paths[0]
            dcfg = plan.compose("distill", output_dir=str(out), **hand_off)
            drafter = plan.add("distill", "distill", out, dcfg, sets)
            drafter_path = str(out / "best")  # what distill ships (its held-out best)
        if "online" in stages:  # adapt the (distilled) drafter on the stream; validate the result
            out = run_dir / "online"
            ocfg = plan.compose("online", output_dir=str(out))
            if drafter_path:
                ocfg.pair.drafter = drafter_path
            drafter = plan.add("online", "online", out, ocfg, [drafter])
            drafter_path = str(out / "drafter")
        reads = [drafter] if drafter else []
        if "validate" in stages:
            report = plan.validate_steps(run_dir, drafter_path, reads, data)
        if required(required(cfg, "long_context"), "enabled", "long_context"):
            plan.long_context_steps(run_dir, drafter_path, drafter)
        if "export" in stages:
            plan.export_step(run_dir, drafter_path, reads, report)
    steps = [*plan.steps, _report_step(cfg, run_dir, plan.steps)]
    check_mapped_plan(cfg.pair, steps)  # before generate spends minutes on a hopeless pair
    check_heldout_plan(steps)  # before generate and distill run for a refused evaluation
    check_steps(steps)  # each stage's config-only checks, before the first step (step_checks.py)
    check_preflight(steps)  # the files and engines each step needs (preflight_plan.py)
    return steps


def step_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / PLAN_DIR / f"{name}.yaml"


def write_plan(steps: list[Step]) -> list[Path]:
    """Each step as `<run_dir>/plan/<name>.yaml` (what its job loads); returns the files."""
    run_dir = steps[-1].out_dir  # the report step's folder is the run's
    files = []
    for step in steps:
        path = step_file(run_dir, step.name)
        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(step.as_dict())))
        files.append(path)
    return files


def load_step(path: str | Path) -> Step:
    """A step written by `write_plan`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such step file (write one with `specdistill plan=true`?)")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return Step(**data)  # type: ignore[arg-type]


def plan_text(steps: list[Step], resources: dict[str, dict[str, Any]] | None = None) -> str:
    """The plan as YAML documents, one per step: name, entry point, needs, folders, config
    (and, for Slurm, the job's resources)."""
    docs = [f"# specdistill plan: {len(steps)} steps under {steps[-1].out_dir}; nothing was run"]
    for step in steps:
        doc = step.as_dict()
        config = doc.pop("config")
        if resources and step.name in resources:
            doc["slurm"] = resources[step.name]
        doc["config"] = config
        docs.append(f"--- # {step.name}: python -m {step.module}\n" + OmegaConf.to_yaml(doc))
    return "\n".join(docs)
