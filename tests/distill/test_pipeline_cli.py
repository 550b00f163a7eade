"""Every `specdistill ...` command the docs show, through the plan mode (`plan=true`).

The forms are read from the docs themselves (README.md, the folder READMEs, the pipeline's and
the experiments' config comments), so a documented command that stops working fails here. The
plan mode composes every step's config and prints it; nothing runs and no model is loaded.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.distill.pipeline.stage import main
from tests.distill.test_pipeline_slurm import SETTINGS, slurm_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "README.md",
    "conf/README.md",
    "distill/README.md",
    "distill/DESIGN.md",
    "slurm/README.md",
    "conf/pipeline.yaml",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conf" / "experiment").glob("*.yaml")),
]


def documented_forms() -> list[str]:
    """`specdistill ...` command lines in the docs: inline code spans, code-block lines and
    config comments; placeholders (STAGE.KEY=VALUE) are not commands."""
    forms: list[str] = []
    for doc in DOCS:
        fenced = False  # inside a ``` block of a README
        for line in (ROOT / doc).read_text().splitlines():
            fenced ^= line.startswith("```")
            found = re.findall(r"`(specdistill(?: [^`]*)?)`", line)
            code = line.strip() if fenced else ""
            if doc.endswith(".yaml") and line.lstrip().startswith("#"):
                code = line.strip().lstrip("#").strip()  # a config's comment
            if re.match(r"specdistill( |$)", code):
                found.append(re.split(r"\s+#", code)[0].strip())
            for form in found:
                if "STAGE.KEY" not in form and form not in forms:
                    forms.append(form)
    return forms


def specdistill(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The console script, in-process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["specdistill", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def plans(out: str) -> list[dict[str, dict]]:
    """The printed plan(s): one {step name: step} per run (a multirun prints several)."""
    runs: list[dict[str, dict]] = []
    for doc in yaml.safe_load_all(out):
        if not doc:
            continue
        if doc["name"] == "generate" or not runs or doc["name"] in runs[-1]:
            runs.append({})
        runs[-1][doc["name"]] = doc
    return runs


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """`specdistill ARGS plan=true` from an empty folder, with Slurm settings in the env."""
    slurm_env(monkeypatch, tmp_path, **SETTINGS)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def run(*args: str, plan: bool = True) -> tuple[int, list[dict[str, dict]], str]:
        code, out, err = specdistill(monkeypatch, capsys, *args, *(["plan=true"] if plan else []))
        return code, (plans(out) if code == 0 else []), err

    return run


def test_the_docs_show_the_forms_the_pipeline_promises():
    forms = documented_forms()
    for expected in [
        "specdistill",
        "specdistill pair=toy-tiny distill.max_steps=50",
        "specdistill serving=sampling serving.sampling.temperature=0.7 serving.sampling.top_p=0.9",
        "specdistill serving=sampling recipe=balanced",
        "specdistill stages=[generate,distill,online,validate,export]",
        "specdistill pair.toy=null pair.target=ORG/BIG pair.drafter=ORG/SMALL dataset=ultrachat",
        "specdistill -m +experiment=recipe_sweep pair=toy sweep_dir=DIR",
    ]:
        assert expected in forms
    assert any("launcher=slurm" in f for f in forms) and any("plan=true" in f for f in forms)
    assert any(re.search(r"distill\.lmbda=0\.5", f) for f in forms)


def _param(form: str):
    """The recipe sweep as documented plans 24 runs (each composes every step): slow-marked; the same sweep cut
    to 2 runs is in test_multirun_sweeps_plan_each_run."""
    full_sweep = "recipe_sweep" in form and "-m" in form and "hydra/launcher" not in form
    return pytest.param(form, marks=pytest.mark.slow) if full_sweep else form


@pytest.mark.parametrize("form", [_param(f) for f in documented_forms()])
def test_documented_form_plans(form, cli, tmp_path, engines_installed):
    (tmp_path / "sweep").mkdir()  # DIR: a folder that exists (a sweep's, a drafter's: the plan
    (tmp_path / "sweep" / "config.json").write_text("{}")  # checks a named drafter's config.json)
    args = [a.replace("DIR", str(tmp_path / "sweep")) for a in shlex.split(form)[1:]]
    args = [a for a in args if a != "plan=true"]
    if "hydra/launcher=slurm" in args:  # a multirun sent to Slurm: compose it, submit nothing
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            cfg = compose(config_name="pipeline", overrides=[a for a in args if a != "-m"],
                          return_hydra_config=True)  # fmt: skip
        launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        assert launcher["partition"] == "gpu" and cfg.hydra.sweeper.params
        return
    code, runs, err = cli(*args)
    assert code == 0, err
    assert runs and all("report" in r for r in runs)
    if "-m" in args:
        assert len(runs) > 1


def test_stage_keys_reach_their_stage(cli):
    code, (p,), _ = cli("pair=toy-tiny", "distill.max_steps=50", "distill.lmbda=0.5",
                        "validate.num_prompts=2", "validate.max_new_tokens=64",
                        "generate.dataset.limit=64", "export.dtype=bf16",
                        "validate.decoder.sampling.top_p=0.9")  # fmt: skip
    assert code == 0
    assert p["validate"]["config"]["decoder"]["sampling"]["top_p"] == 0.9
    assert (p["distill"]["config"]["max_steps"], p["distill"]["config"]["lmbda"]) == (50, 0.5)
    for name in ("validate", "validate_base"):
        assert p[name]["config"]["num_prompts"] == 2
        assert p[name]["config"]["max_new_tokens"] == 64
    assert p["generate"]["config"]["dataset"]["limit"] == 64
    assert p["export"]["config"]["dtype"] == "bf16"
    assert p["generate"]["config"]["pair"]["toy"] == "toy-tiny"


def test_serving_and_recipe_reach_their_stages(cli):
    _, (p,), _ = cli("serving=sampling", "serving.sampling.temperature=0.7",
                     "serving.sampling.top_p=0.9")  # fmt: skip
    dec = p["validate"]["config"]["decoder"]["sampling"]
    assert (dec["temperature"], dec["top_p"]) == (0.7, 0.9)
    assert p["distill"]["config"]["eval"]["sampling"]["temperature"] == 0.7
    assert p["report"]["config"]["serving"]["mode"] == "sampling"
    _, (p,), _ = cli("serving=sampling", "recipe=balanced")
    assert p["report"]["config"]["recipe"]["name"] == "balanced"


def test_online_and_a_real_pair(cli):
    _, (p,), _ = cli("stages=[generate,distill,online,validate,export]")
    assert list(p) == ["generate", "distill", "online", "validate_base", "validate", "export",
                       "report"]  # fmt: skip
    assert p["validate"]["config"]["pair"]["drafter"].endswith("/online/drafter")
    assert p["online"]["needs"] == ["distill"]
    _, (p,), _ = cli("pair.toy=null", "pair.target=ORG/BIG", "pair.drafter=ORG/SMALL",
                     "dataset=ultrachat")  # fmt: skip
    for name in ("generate", "distill", "validate"):
        c = p[name]["config"]
        assert (c["pair"]["toy"], c["pair"]["target"]) == (None, "ORG/BIG")
        assert c["dataset"]["name"] == "HuggingFaceH4/ultrachat_200k"
    assert p["generate"]["config"]["dataset"]["limit"] == 512  # the pipeline's own size
    assert p["validate_base"]["config"]["pair"]["drafter"] == "ORG/SMALL"


def test_a_pipeline_dataset_over_a_sized_pair_plans_without_reading_it(cli, monkeypatch):
    """`specdistill plan=true pair=smollm2 dataset=ultrachat`: the pair's sizing gives generate
    dataset keys the hub set lacks (`toy`, `limit`); they merge over it like the user's own, and
    the plan reads no prompts (it printed an OmegaConf struct traceback before)."""
    import specdistill.data.dataset_rows as rows
    import specdistill.data.prompts as prompts

    def no_reading(*_a, **_k):
        raise AssertionError("the plan read the dataset")

    for module, name in ((rows, "hub_rows"), (prompts, "hub_rows"), (prompts, "load_prompts")):
        monkeypatch.setattr(module, name, no_reading)
    code, (p,), err = cli("pair=smollm2", "dataset=ultrachat")
    assert code == 0, err
    for name in ("generate", "distill", "validate"):
        assert p[name]["config"]["dataset"]["name"] == "HuggingFaceH4/ultrachat_200k"
    assert p["generate"]["config"]["dataset"]["limit"] == 1024  # conf/sizing/smollm2.yaml


def test_the_sized_pair_plans_its_parallel_chains_and_a_user_key_wins(cli):
    """conf/sizing/smollm2.yaml sizes a parallel drafter's chains for a CPU; STAGE.KEY=VALUE wins."""
    code, (p,), err = cli("pair=smollm2", "drafting=parallel")
    assert code == 0, err
    par = p["distill"]["config"]["parallel"]
    assert (par["depth"], par["anchors"]) == (2, 16)
    code, (p,), err = cli("pair=smollm2", "drafting=parallel", "distill.parallel.depth=6")
    assert code == 0, err
    assert p["distill"]["config"]["parallel"]["depth"] == 6
    code, (p,), err = cli("pair=toy-tiny", "drafting=parallel")
    assert code == 0, err
    assert p["distill"]["config"]["parallel"]["depth"] == 8  # conf/distill.yaml's own


def test_multirun_sweeps_plan_each_run(cli, tmp_path):
    code, runs, _ = cli("-m", "pair=toy-tiny", "distill.lmbda=0.0,0.5")
    assert code == 0 and [r["distill"]["config"]["lmbda"] for r in runs] == [0.0, 0.5]
    code, runs, _ = cli("-m", "+experiment=recipe_sweep", "pair=toy-tiny",
                        f"sweep_dir={tmp_path / 'sweep'}", "recipe.loss=fkl,tvd",
                        "recipe.lmbda=1.0", "recipe.seqkd=greedy")  # fmt: skip
    assert code == 0 and len(runs) == 2
    assert [r["distill"]["config"]["loss"]["name"] for r in runs] == ["fkl", "tvd"]
    for r in runs:  # one shared Seq-KD folder, validated on a second prompt set too
        assert r["generate"]["out_dir"] == str(tmp_path / "sweep" / "seqkd-greedy")
        assert "validate_stdlib-tests" in r and "validate_base" not in r


def test_slurm_plan_shows_placement_and_needs_the_settings(cli, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_NODES", "2")
    # a hub pair without a sizing file: placement from the cluster settings alone
    code, (p,), _ = cli("launcher=slurm", "run_dir=/runs/llama", "pair=qwen2.5",
                        "distill.deepspeed=zero3")  # fmt: skip
    assert code == 0
    assert p["distill"]["slurm"]["nodes"] == 2 and p["distill"]["config"]["deepspeed"]
    assert p["distill"]["out_dir"] == "/runs/llama/distill"
    monkeypatch.delenv("SPECDISTILL_TIME")
    code, _, err = cli("launcher=slurm")
    assert code == 2 and err.strip().splitlines() == [err.strip()]
    assert err.startswith("error: SPECDISTILL_TIME is not set")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["distill.no_such_key=1"], "error: distill: no key `no_such_key` in the distill stage"),
        (["validate.nope=1"], "error: validate: no key `nope` in the validate stage"),
        (["generate.dataset.nope=1"], "error: generate: no key `dataset.nope` in the generate"),
        (["stages=[generate,train]"], "error: stages=['generate', 'train']: unknown ['train']"),
        (["launcher=pbs"], "error: launcher='pbs': use launcher=local or launcher=slurm"),
        (["serving.sampling.temperature=0.7"], "error: serving.sampling.temperature=0.7 with"),
    ],
)
def test_a_bad_key_is_one_error_line_and_exit_2(cli, args, message):
    for plan in (True, False):  # the same line whether planning or running: nothing ran
        code, _, err = cli(*args, plan=plan)
        assert code == 2 and err.startswith(message), err
        assert len([x for x in err.splitlines() if x.strip()]) == 1, err


def test_console_script_plan_writes_nothing(tmp_path):
    """The installed `specdistill` itself: plan=true prints, and leaves no folder behind."""
    exe = Path(sys.executable).with_name("specdistill")
    proc = subprocess.run([str(exe), "pair=toy-tiny", "serving=sampling", "plan=true"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (p,) = plans(proc.stdout)
    assert p["distill"]["config"]["lmbda"] == 1.0
    assert list(tmp_path.iterdir()) == []


def test_llamacpp_true_without_a_binary_stops_before_any_step(cli, monkeypatch, tmp_path):
    """`specdistill llamacpp=true` with no llama-server built: the plan and the run both stop
    with validate's own line naming the build command, and no step has run (validate's check
    would otherwise come after generate and distill)."""
    from specdistill.decode.llamacpp import build

    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "no-build")
    monkeypatch.delenv("SPECDISTILL_LLAMA_SERVER", raising=False)
    for plan in (True, False):
        code, _, err = cli(f"run_dir={tmp_path / 'run'}", "pair=toy-tiny", "llamacpp=true",
                           plan=plan)  # fmt: skip
        assert code == 2
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            "error: validate_base: engines=[ours,llamacpp]: llama-server is not built"
        )
        assert not (tmp_path / "run" / "generate").exists()
    code, runs, err = cli(f"run_dir={tmp_path / 'run'}", "pair=toy-tiny", "llamacpp=true",
                        "validate.engines=[ours]")  # fmt: skip
    assert code == 0, err
    assert runs[0]["validate"]["config"]["engines"] == ["ours"]  # the user's key
    assert runs[0]["validate_base"]["config"]["engines"] == ["ours"]


def test_vllm_true_without_vllm_stops_before_any_step(cli, monkeypatch, tmp_path):
    """`specdistill vllm=true` where vLLM is missing: the plan and the run both stop with the
    export's own line, and no step has run (the export's check would otherwise come after
    generate, distill and validate)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    for plan in (True, False):
        code, _, err = cli(f"run_dir={tmp_path / 'run'}", "pair=toy-tiny", "vllm=true", plan=plan)
        assert code == 2
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1
        assert lines[0].startswith("error: export: vllm.enabled=true but vLLM is not installed")
        assert not (tmp_path / "run" / "generate").exists()
