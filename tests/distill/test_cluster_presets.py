"""The cluster presets (`pair=llama3`, `pair=qwen3`: conf/sizing/cluster.yaml) plan as a cluster
user would submit them, and the plan refuses a preset's or chat mode's bad combination before
anything is written (every stage's run-time refusals: tests/distill/test_plan_refuses_first.py)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.distill.export.card import _chat_line
from specdistill.distill.pipeline import slurm
from specdistill.distill.pipeline.chat_modes import chat_modes
from specdistill.distill.pipeline.plan import build_plan
from specdistill.distill.pipeline.stage import check_set_keys
from specdistill.distill.train import rollouts
from specdistill.distill.train.data import chat_record
from specdistill.distill.train.settings import DataSettings
from tests.conftest import stage_node
from tests.distill.test_pipeline_slurm import slurm_env


def _cfg(run_dir, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="pipeline", overrides=[f"run_dir={run_dir}", *overrides])


@pytest.mark.parametrize("pair", ["llama3", "qwen3"])
def test_both_presets_plan_with_the_cluster_values(tmp_path, monkeypatch, pair, engines_installed):
    slurm_env(monkeypatch, tmp_path, SPECDISTILL_PARTITION="gpu")  # the cluster's partition only
    cfg = _cfg(tmp_path / "run", f"pair={pair}", "launcher=slurm")
    steps = {s.name: s for s in build_plan(cfg)}
    jobs = slurm.resources(list(steps.values()), cfg)
    gens = [s for s in steps.values() if s.stage == "generate"]
    assert len(gens) == (2 if pair == "qwen3" else 1)
    for g in gens:
        c = g.config
        assert (c["backend"], c["dtype"], c["dataset"]["name"]) == (
            "vllm", "bf16", "HuggingFaceH4/ultrachat_200k")  # fmt: skip
        assert c["topk_logprobs"] > 0 and c["vllm"]["max_model_len"] >= 2048
        assert (jobs[g.name].array, jobs[g.name].gpus_per_node) == (8, 1)
    d = steps["distill"].config
    assert d["max_seq_len"] >= 2048 and d["mixed_precision"] == "bf16"
    assert d["fsdp"] is True and d["pack_sequences"] is True and d["deepspeed"]["enabled"] is False
    assert d["onpolicy"]["engine"] == "transformers"  # the rollouts FSDP2 can serve
    assert d["optim"]["optimizer"]["_target_"] == "torch.optim.AdamW"
    assert d["optim"]["optimizer"]["lr"] == 1.0e-4 and d["optim"]["warmup_steps"] > 0
    assert d["data"]["path"] == ([g.out_dir for g in gens] if len(gens) > 1 else gens[0].out_dir)
    dj = jobs["distill"]
    assert (dj.nodes, dj.gpus_per_node, dj.tasks_per_node) == (2, 8, 8)
    assert dj.signal_delay_s > 90 and dj.minutes >= 12 * 60
    for name in ("validate_base", "validate", "export"):
        assert jobs[name].gpus_per_node == 1 and jobs[name].partition == "gpu"
        assert jobs[name].minutes < dj.minutes
    assert steps["validate"].config["dtype"] == "bf16" == steps["export"].config["dtype"]
    assert jobs["report"].gpus_per_node == 0
    if pair == "qwen3":  # trained on both modes, validated in both, thinking served
        kw = {n: s.config["dataset"]["chat_template_kwargs"] for n, s in steps.items()
              if s.stage in ("generate", "distill", "validate")}  # fmt: skip
        assert kw == {
            "generate_thinking": {"enable_thinking": True},
            "generate_direct": {"enable_thinking": False},
            "distill": {"enable_thinking": True},  # its held-out eval: the served mode
            "validate_base": {"enable_thinking": True},
            "validate": {"enable_thinking": True},
            "validate_direct": {"enable_thinking": False},
        }
        assert steps["validate_direct"].config["training_data"] == steps["generate_direct"].out_dir
        assert d["max_seq_len"] >= 4096


@pytest.mark.parametrize("pair", ["llama3", "qwen3"])
def test_sampled_serving_of_a_preset_plans_and_trains_the_full_head(
    tmp_path, pair, engines_installed
):
    steps = {
        s.name: s for s in build_plan(_cfg(tmp_path / "r", f"pair={pair}", "serving=sampling"))
    }
    d = steps["distill"].config
    assert d["lmbda"] == 1.0 and d["fsdp"] is True and d["onpolicy"]["engine"] == "transformers"
    assert d["draft_vocab_train"] is False
    greedy = build_plan(_cfg(tmp_path / "g", f"pair={pair}"))
    assert greedy[1 + (pair == "qwen3")].config["draft_vocab_train"] == "auto"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["pair=llama3", "++distill.deepspeed=zero3"], r"^distill: fsdp=true: DeepSpeed"),
        (["chat_modes={think: true}"], r"^chat_modes.think=True must be a mapping"),
        (
            ["chat_modes={a: {enable_thinking: true}}", "served_chat_mode=b"],
            r"^served_chat_mode='b' is not a chat_modes label",
        ),
    ],
)
def test_a_preset_refusal_is_made_at_plan_time(tmp_path, overrides, match, engines_installed):
    with pytest.raises(ConfigError, match=match) as e:
        build_plan(_cfg(tmp_path / "run", "pair=toy-tiny", *overrides))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_auto_rollouts_stay_in_transformers_where_vllm_cannot_serve():
    """One rule for the plan and the trainer: `auto` never resolves to a refused vLLM engine."""
    for sharded in ({"zero_stage": 3, "fsdp": False}, {"zero_stage": 0, "fsdp": True}):
        assert rollouts.asked_engine("auto", True, mapped=False, parallel=False, **sharded) == (
            "transformers")  # fmt: skip
    assert rollouts.asked_engine("auto", True, 0, True, False, False) == "transformers"
    assert rollouts.asked_engine("auto", True, 2, False, False, False) == "auto"  # by machine
    assert rollouts.asked_engine("vllm", False, 3, False, False, False) == "transformers"
    with pytest.raises(ConfigError, match="a parallel drafter's rollouts"):
        rollouts.asked_engine("vllm", True, 0, False, True, False)


def test_distill_reads_every_chat_modes_rows_and_the_card_names_the_served_mode(tmp_path):
    folders = []
    for label, thinking in (("thinking", True), ("direct", False)):
        folder = tmp_path / label
        folder.mkdir()
        record = {"chat_turns": 2 + thinking, "chat_template_kwargs": {"enable_thinking": thinking}}
        (folder / "generation_config.json").write_text(json.dumps(record))
        folders.append(str(folder))
    data = DataSettings.from_node(stage_node("distill", "data", path=folders))
    assert data.paths == tuple(folders)
    assert DataSettings.from_node(stage_node("distill", "data", path=folders[0])).paths == (
        folders[0],
    )
    with pytest.raises(ConfigError, match=r"^data.path=\[\] must be a folder or a non-empty list"):
        DataSettings.from_node(stage_node("distill", "data", path=[]))
    chat = chat_record(data.paths)["chat"]
    assert chat["template_kwargs"] == {"enable_thinking": True} and chat["turns"] == 3
    assert chat["trained_template_kwargs"] == [{"enable_thinking": True},
                                               {"enable_thinking": False}]  # fmt: skip
    (line,) = _chat_line(chat)
    assert "trained on every mode" in line
    assert "the served mode, the one validated as `validate`: `chat_template_kwargs={" in line
    assert "enable_thinking': True}" in line.rsplit("served mode", 1)[1]
    assert "trained_template_kwargs" not in chat_record(folders[0])["chat"]


def test_chat_modes_served_first(tmp_path):
    modes = "chat_modes={a: {x: 1}, b: {x: 2}}"
    assert [m for m, _ in chat_modes(_cfg(tmp_path, modes))] == ["a", "b"]
    assert [m for m, _ in chat_modes(_cfg(tmp_path, modes, "served_chat_mode=b"))] == ["b", "a"]
    assert chat_modes(_cfg(tmp_path)) == []


@pytest.mark.parametrize(
    ("pair", "train_set"),
    [("llama3", "HuggingFaceH4/ultrachat_200k"), ("qwen3", "HuggingFaceH4/ultrachat_200k"),
     ("smollm2-chat", "mixture")],
)  # fmt: skip
def test_a_key_of_the_set_a_sizing_picks_keeps_the_set(
    tmp_path, pair, train_set, engines_installed
):
    """`generate.dataset.limit=N` over a pair whose sizing picks the set (conf/sizing/cluster.yaml's
    `/dataset@generate.dataset: ultrachat`) changes that set's key: the set stays, it does not
    fall back to the stage's default code prompts."""
    keys = ["++generate.dataset.limit=100", "++distill.dataset.seed=7"]
    steps = build_plan(_cfg(tmp_path / "r", f"pair={pair}", *keys))
    gens = [s.config["dataset"] for s in steps if s.stage == "generate"]
    d = next(s.config["dataset"] for s in steps if s.name == "distill")
    for dataset in (*gens, d):
        assert dataset.get("name") == train_set or dataset["source"] == train_set, dataset
    assert all(g["limit"] == 100 for g in gens) and d["seed"] == 7
    assert next(s for s in steps if s.name == "validate").config["dataset"]["source"] == "mixture"


@pytest.mark.parametrize("keys", [[], ["+dataset.chat_template_kwargs={enable_thinking: false}"]])
def test_a_validate_set_reads_its_own_set_where_the_sizing_picks_validate_s(tmp_path, keys):
    """validate_<set> reads the set it names, also under a pipeline `dataset` node (whose
    template arguments it takes), though the sizing picks validate's set as a whole node."""
    cfg = _cfg(tmp_path / "r", "pair=smollm2-chat", "validate_sets=[gsm8k]", *keys)
    steps = {s.name: s for s in build_plan(cfg)}
    assert steps["validate"].config["dataset"]["source"] == "mixture"  # chat_bench
    own = steps["validate_gsm8k"].config["dataset"]
    assert own["path"]["test"] == "local:gsm8k/test.jsonl" and "mixture" not in own
    assert own["chat_template_kwargs"] == ({"enable_thinking": False} if keys else {})


def test_a_set_picked_by_name_with_a_key_of_it_is_refused_and_the_node_form_plans(tmp_path):
    """`generate.dataset=chat_mix generate.dataset.limit=5` would read the toy set (Hydra replaces
    the name with the key's node): one line naming the spelling that keeps both, which plans."""
    with pytest.raises(ConfigError, match=r"^generate.dataset=chat_mix with generate.dataset."
                                          r"limit: .*\+dataset@generate.dataset=chat_mix"):  # fmt: skip
        check_set_keys(["pair=toy-tiny", "generate.dataset=chat_mix", "generate.dataset.limit=5"])
    check_set_keys(["generate.dataset=chat_mix", "distill.dataset.limit=5"])  # another stage's
    check_set_keys(["generate.dataset={source: jsonl}", "generate.dataset.path=x.jsonl"])
    cfg = _cfg(tmp_path, "pair=toy-tiny", "+dataset@generate.dataset=chat_mix",
               "++generate.dataset.limit=5")  # fmt: skip
    gen = build_plan(cfg)[0].config["dataset"]
    assert (gen["source"], gen["limit"]) == ("mixture", 5)
