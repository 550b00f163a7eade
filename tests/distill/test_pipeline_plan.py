"""The plan: every step's config composed once, the same for the local and the Slurm executor."""

from __future__ import annotations

import io

import yaml
from hydra import compose, initialize_config_module

from specdistill.distill.pipeline import slurm
from specdistill.distill.pipeline.plan import build_plan, load_step, step_file, write_plan
from specdistill.distill.pipeline.stage import show_plan
from tests.distill.test_pipeline_slurm import SETTINGS, slurm_env, submitted_call

SAMPLING = ["serving=sampling"]


def _cfg(run_dir, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="pipeline", overrides=["pair=toy-tiny", f"run_dir={run_dir}", *overrides]
        )


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_local_and_slurm_plans_are_the_same_stage_configs(tmp_path, monkeypatch):
    """`specdistill serving=sampling`: the configs the local executor runs are the ones the
    Slurm jobs load, step for step; and the two printed plans differ only by placement."""
    slurm_env(monkeypatch, tmp_path, **SETTINGS, SPECDISTILL_NODES="2",
              SPECDISTILL_GENERATE_TASKS="2")  # fmt: skip
    run = tmp_path / "run"
    local = build_plan(_cfg(run, *SAMPLING))
    ids = slurm.submit(_cfg(run, *SAMPLING, "launcher=slurm"), out=io.StringIO())
    assert list(ids) == [s.name for s in local]
    for step in local:
        submitted = load_step(step_file(run, step.name))
        assert submitted.config == step.config, step.name
        assert (submitted.needs, submitted.fingerprint) == (step.needs, step.fingerprint)
        job = ids[step.name] + ("_0" if step.name == "generate" else "")
        assert submitted_call(run, job)[1][0] == str(step_file(run, step.name))
    assert local[1].config["lmbda"] == 1.0  # the sampling recipe reached distill
    assert local[3].config["decoder"]["sampling"]["temperature"] == 1.0  # and validate's decoder

    here = _docs(show_plan(_cfg(run, *SAMPLING, "plan=true")))
    there = _docs(show_plan(_cfg(run, *SAMPLING, "plan=true", "launcher=slurm")))
    placement = {d["name"]: d.pop("slurm") for d in there}
    assert here == there
    assert (placement["generate"]["array"], placement["distill"]["nodes"]) == (2, 2)


def test_hand_offs_are_paths_known_up_front(tmp_path):
    run = tmp_path / "run"
    steps = {s.name: s for s in build_plan(_cfg(run, "validate_sets=[stdlib-tests]"))}
    assert list(steps) == ["generate", "distill", "validate_base", "validate",
                           "validate_stdlib-tests", "export", "report"]  # fmt: skip
    gen, dis, base, val, extra, exp, rep = steps.values()
    assert dis.config["data"]["path"] == gen.out_dir == str(run / "generate")
    best = str(run / "distill" / "best")
    assert val.config["pair"]["drafter"] == extra.config["pair"]["drafter"] == best
    assert base.config["pair"]["drafter"] is None  # the toy's own base drafter
    assert (
        extra.config["dataset"]["group"] == "stdlib-tests"
        and val.config["dataset"]["source"] == "toy"
    )
    assert (exp.config["drafter"], exp.config["report"]) == (best, str(val.result_path))
    assert exp.config["output_dir"] == str(run / "export" / "drafter")
    # every validate step refuses prompts among the run's Seq-KD rows, so it waits for them
    assert dis.needs == base.needs == ["generate"] and val.needs == ["distill", "generate"]
    assert {s.config["training_data"] for s in (base, val, extra)} == {gen.out_dir}
    assert exp.needs == ["distill", "validate"]
    assert rep.needs == [s for s in steps if s != "report"]
    assert rep.config["results"]["export"] == str(run / "export" / "drafter" / "export.json")
    online = {s.name: s for s in build_plan(_cfg(run, "stages=[distill,online,validate]"))}
    assert online["online"].config["pair"]["drafter"] == best
    assert online["validate"].config["pair"]["drafter"] == str(run / "online" / "drafter")
    assert online["validate"].needs == ["online"] and online["online"].needs == ["distill"]
    assert online["distill"].config["data"]["path"] is None  # no generate: distill's own


def test_fingerprints_follow_what_a_step_reads(tmp_path):
    a = {s.name: s.fingerprint for s in build_plan(_cfg(tmp_path))}
    b = {s.name: s.fingerprint for s in build_plan(_cfg(tmp_path, "++distill.max_steps=5"))}
    assert a == {s.name: s.fingerprint for s in build_plan(_cfg(tmp_path))}  # deterministic
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"distill", "validate", "export"}  # not generate, not the base drafter


def test_step_files_round_trip(tmp_path):
    steps = build_plan(_cfg(tmp_path / "run"))
    files = write_plan(steps)
    assert [f.name for f in files] == [f"{s.name}.yaml" for s in steps]
    assert [load_step(f) for f in files] == steps


def test_vllm_flag_validates_the_exported_drafter_in_vllm(tmp_path, engines_installed):
    """`specdistill vllm=true`: the export step checks its folder in vLLM; a changed flag re-runs
    the export only."""
    run = tmp_path / "run"
    plain = {s.name: s for s in build_plan(_cfg(run))}
    steps = {s.name: s for s in build_plan(_cfg(run, "vllm=true"))}
    exp = steps["export"].config
    assert exp["vllm"]["enabled"] is True and not plain["export"].config["vllm"]["enabled"]
    assert exp["vllm"]["output_dir"] == str(run / "export" / "drafter") + "_vllm"
    changed = [n for n in steps if n != "report" and steps[n].fingerprint != plain[n].fingerprint]
    assert changed == ["export"]


LONG = "long_context.enabled=true"


def test_long_context_leg_fine_tunes_the_runs_drafter_and_validates_three_by_bucket(tmp_path):
    """`long_context.enabled=true`: Seq-KD rows after long train-split prompts, the
    distilled drafter fine-tuned on them (reading distill's short held-out rows, never the
    target), then base, short- and long-trained drafters validated on held-out long prompts;
    each long step takes its stage's section of the pipeline config under the leg's own keys,
    except the section's dataset keys, which belong to the short set."""
    run = tmp_path / "run"
    user = ["++generate.dataset.limit=12", "++generate.topk_logprobs=4",
            "++distill.loss_chunk_size=128", "++distill.micro_batch_size=4",
            "++long_context.validate.dataset.per_bucket=3"]  # fmt: skip
    cfg = _cfg(run, LONG, *user)
    plain = {s.name: s for s in build_plan(_cfg(run, *user))}
    steps = {s.name: s for s in build_plan(cfg)}
    assert list(steps) == ["generate", "distill", "validate_base", "validate", "generate_long",
                           "distill_long", "validate_long_base", "validate_long_short",
                           "validate_long", "export", "report"]  # fmt: skip
    for name in plain:  # the short run's steps are untouched by the leg
        if name != "report":
            assert steps[name].fingerprint == plain[name].fingerprint, name
    gen, dis, long = steps["generate_long"], steps["distill_long"], steps["distill"]
    assert gen.out_dir == str(run / "generate_long") and gen.needs == []
    g = gen.config
    assert g["dataset"]["source"] == "long" and g["dataset"]["split"] is None  # generate: train
    assert g["dataset"]["limit"] is None and g["topk_logprobs"] == 4  # not the short set's limit
    assert (g["batch_size"], g["chunk_size"]) == (1, 4)
    d = dis.config
    assert (
        d["pair"]["drafter"] == str(run / "distill" / "best") and d["data"]["path"] == gen.out_dir
    )
    assert (d["eval"]["source"], d["eval"]["path"]) == (
        "path", str(run / "distill" / "eval_continuations"))  # fmt: skip
    assert (d["micro_batch_size"], d["loss_chunk_size"], d["max_steps"]) == (1, 128, 20)
    assert dis.needs == ["generate_long", "distill"] and long.config["micro_batch_size"] == 4
    drafters = {n: steps[n].config["pair"]["drafter"] for n in
                ("validate_long_base", "validate_long_short", "validate_long")}  # fmt: skip
    assert drafters == {"validate_long_base": None,
                        "validate_long_short": str(run / "distill" / "best"),
                        "validate_long": str(run / "distill_long" / "final")}  # fmt: skip
    assert [steps[n].needs for n in drafters] == [[], ["distill"], ["distill_long"]]
    for name in drafters:
        v = steps[name].config
        assert v["dataset"]["source"] == "long" and v["dataset"]["per_bucket"] == 3
        assert (v["num_prompts"], v["both_modes"], v["hf_assisted"]) == (None, False, False)
    assert steps["validate_long_base"].config["decoder"]["drafting"] == "autoregressive"
    assert cfg.distill.micro_batch_size == 4  # the plan composed copies, not the user's config
    assert steps["export"].config["drafter"] == str(run / "distill" / "best")  # still the run's

    # A changed long fine-tune re-runs what reads it, nothing of the short run.
    changed = _cfg(run, LONG, *user, "long_context.distill.max_steps=7")
    again = {s.name: s.fingerprint for s in build_plan(changed)}
    assert [n for n in again if again[n] != steps[n].fingerprint] == [
        "distill_long",
        "validate_long",
    ]


def test_long_context_leg_without_distill_or_after_online(tmp_path):
    """Without a distill step the leg fine-tunes the pair's drafter and validates two drafters
    (base and long); after online it fine-tunes the online drafter, whose stage wrote no short
    held-out rows, so distill_long keeps its own eval."""
    run = tmp_path / "run"
    steps = {s.name: s for s in build_plan(_cfg(run, LONG, "stages=[generate,validate]"))}
    assert [n for n in steps if "long" in n] == ["generate_long", "distill_long",
                                                 "validate_long_base", "validate_long"]  # fmt: skip
    assert steps["distill_long"].config["pair"]["drafter"] is None
    assert steps["distill_long"].needs == ["generate_long"]
    online = {s.name: s for s in build_plan(_cfg(run, LONG, "stages=[distill,online,validate]"))}
    d = online["distill_long"].config
    assert d["pair"]["drafter"] == str(run / "online" / "drafter")
    assert d["eval"]["source"] == "target" and d["eval"]["path"] is None
    assert online["validate_long_short"].config["pair"]["drafter"] == d["pair"]["drafter"]
    assert "validate_long_base" not in {
        s.name for s in build_plan(_cfg(run, LONG, "stages=[generate,distill]"))
    }


def test_llamacpp_true_serves_every_validate_step_in_llama_cpp_and_exports_gguf(
    tmp_path, engines_installed
):
    steps = {s.name: s for s in build_plan(_cfg(tmp_path / "run", "llamacpp=true"))}
    for name in ("validate_base", "validate"):
        assert steps[name].config["engines"] == ["ours", "llamacpp"], name
    assert steps["export"].config["gguf"]["enabled"] is True
    plain = {s.name: s for s in build_plan(_cfg(tmp_path / "r3"))}
    assert plain["validate"].config["engines"] == ["ours"]
    assert plain["export"].config["gguf"]["enabled"] is False
