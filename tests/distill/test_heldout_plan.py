"""`specdistill plan=true` refuses, from the configs alone, a run whose validate steps or
distill eval would read training rows (distill/pipeline/heldout_plan.py), and hands the
pipeline's chat template arguments to every step that renders a prompt."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.heldout_check import row_sides
from specdistill.data.runtime import ConfigError
from specdistill.data.splits import EVAL
from specdistill.distill.pipeline.plan import DATASET_STAGES, build_plan
from tests.distill.test_pipeline_cli import cli  # noqa: F401  (the `cli` fixture)

VALIDATE_STEPS = ("validate_base", "validate")


def _plan(tmp_path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose("pipeline", overrides=[f"run_dir={tmp_path / 'run'}", *overrides])
    return {s.name: s for s in build_plan(cfg)}


def test_ultrachat_as_it_was_is_refused_before_any_step(cli):  # noqa: F811
    """train_sft for every stage, no holdout: one error line naming the validate steps, the
    split and the fix, exit 2 (validate used to refuse it after generate and distill ran)."""
    code, plans, err = cli("pair=smollm2", "dataset=ultrachat", "dataset.split=train_sft")
    assert code == 2 and not plans
    (line,) = err.strip().splitlines()
    assert line.startswith("error: validate_base, validate would evaluate on rows that generate")
    assert "split 'train_sft' of hub HuggingFaceH4/ultrachat_200k" in line
    assert "dataset.splits: {train: NAME, test: NAME}" in line and "dataset.holdout" in line


def test_ultrachat_by_default_evaluates_on_its_test_split(cli):  # noqa: F811
    code, (p,), err = cli("pair=smollm2", "dataset=ultrachat")
    assert code == 0, err
    assert row_sides(p["generate"]["config"]["dataset"], "train")[0].split == "train_sft"
    for name in VALIDATE_STEPS:
        assert row_sides(p[name]["config"]["dataset"], EVAL)[0].split == "test_sft"
    dis = p["distill"]["config"]
    evaluation = {**dis["dataset"], "split": dis["eval"]["split"]}  # as distill reads it
    assert row_sides(evaluation, EVAL)[0].split == "test_sft"


@pytest.mark.parametrize("name", ["instructions", "gsm8k", "sharegpt", "chat_mix"])
def test_every_shipped_chat_set_plans_as_the_pipelines_set(tmp_path, name):
    steps = _plan(tmp_path, "pair=smollm2", f"dataset={name}", "validate_sets=[chat_bench]")
    assert {"generate", "distill", *VALIDATE_STEPS, "validate_chat_bench"} <= set(steps)


def test_training_on_an_evaluation_set_names_distills_eval_too(tmp_path):
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, "pair=smollm2", "dataset=mt_bench")
    text = str(e.value)
    assert text.startswith("distill (eval), validate_base, validate would evaluate on rows")
    assert "split 'test' of file local:mt_bench/question.jsonl" in text and "\n" not in text
    assert "train on another set (generate.dataset=NAME)" in text


def test_a_different_holdout_on_the_evaluation_side_is_refused(tmp_path):
    """Validate's set cut by another holdout than generate's: its held-out conversations may
    be generate's training rows (a user's section can set that; here set on the planned step)."""
    from specdistill.distill.pipeline.heldout_plan import check_heldout_plan

    steps = _plan(tmp_path, "pair=smollm2", "dataset=sharegpt")
    check_heldout_plan(list(steps.values()))  # as planned: one holdout, opposite sides
    steps["validate"].config["dataset"]["holdout"] = {"share": 0.1, "seed": 0}
    with pytest.raises(ConfigError) as e:
        check_heldout_plan(list(steps.values()))
    assert str(e.value).startswith("validate would evaluate on rows that generate trains on")
    assert "{share: 0.05, count: None, seed: 0} for training but {share: 0.1" in str(e.value)


def test_the_chat_pair_keeps_its_held_out_sizing(tmp_path):
    steps = _plan(tmp_path, "pair=smollm2-chat")
    mix = steps["generate"].config["dataset"]
    assert mix["limit"] == 1024 and steps["distill"].config["eval"]["limit"] == 16
    assert [m.get("holdout") for m in mix["mixture"]] == [{"count": 32, "seed": 0},
        {"count": 64, "seed": 0}, {"count": 32, "seed": 0}, {"count": 32, "seed": 0}]  # fmt: skip
    assert steps["validate"].config["dataset"]["mixture"][0]["label"] == "mt_bench"


@pytest.mark.parametrize(
    "overrides",
    [
        ("pair=smollm2", "dataset=instructions", "validate_sets=[mt_bench,gsm8k]"),
        ("pair=smollm2-chat", "validate_sets=[mt_bench]"),
    ],
)
def test_template_kwargs_reach_every_step_that_renders_a_prompt(tmp_path, overrides):
    """`+dataset.chat_template_kwargs=...` reaches the steps that pick their own set
    (validate_<set>, a sizing's chat_mix/chat_bench) as it reaches the others."""
    steps = _plan(tmp_path, *overrides, "+dataset.chat_template_kwargs={enable_thinking: true}")
    rendering = [s for s in steps.values() if s.stage in DATASET_STAGES]
    assert "validate_mt_bench" in steps and len(rendering) >= 5
    for step in rendering:
        kwargs = step.config["dataset"]["chat_template_kwargs"]
        assert kwargs == {"enable_thinking": True}, step.name


def test_template_kwargs_alone_keep_each_stages_own_set(tmp_path):
    """A pipeline `dataset` node without a source is keys over each stage's set, not a set."""
    steps = _plan(tmp_path, "pair=smollm2", "+dataset.chat_template_kwargs={enable_thinking: true}")
    gen = steps["generate"].config["dataset"]
    assert (gen["source"], gen["toy"], gen["limit"]) == ("toy", "toy", 1024)
    assert steps["validate"].config["dataset"]["source"] == "toy"
    assert gen["chat_template_kwargs"] == {"enable_thinking": True}


def test_distills_target_eval_reads_eval_split_as_the_plan_does(monkeypatch, tmp_path):
    """eval.source=target generates the eval continuations from eval.split even where the set
    names one split for every stage (mt_bench's `split: test`, a user's dataset.split)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from specdistill.distill.train.sources import run_generate

    seen = []
    monkeypatch.setattr("specdistill.data.generate.stage.run", lambda gcfg: seen.append(gcfg))
    s = SimpleNamespace(seed=0, device="cpu", eval=SimpleNamespace(limit=4))
    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    cfg = OmegaConf.create({"pair": {"toy": "toy-tiny"}, "dataset": {"source": "hub",
                            "name": "ORG/chat", "split": "train_sft"}})  # fmt: skip
    run_generate(s, cfg, accelerator, tmp_path / "eval", "validation", {})
    run_generate(s, cfg, accelerator, tmp_path / "seqkd", "train", {})
    assert [(g.split, g.dataset.split) for g in seen] == [
        ("validation", "validation"),  # the eval role wins over the set's split
        ("train", "train_sft"),  # training keeps the set's own
    ]
