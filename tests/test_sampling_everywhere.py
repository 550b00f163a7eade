"""One sampling spec everywhere sampling happens: the same `{temperature, top_k, top_p}` node in
every stage's config, no stray per-key spellings, and bad values as exit status 2 with one
`error:` line naming the node's field, stage by stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import KEYS, Sampling
from tests.conftest import main_in_process, tiny_llama

# (primary config, overrides, where its sampling spec lives)
PLACES = [
    ("validate", [], "decoder.sampling"),
    ("validate", ["decoder=sampling"], "decoder.sampling"),
    ("validate", [], "other_sampling"),
    ("online", [], "decoder.sampling"),
    ("distill", [], "eval.sampling"),
    ("distill", [], "onpolicy.sampling"),
    ("distill", [], "data.generate.sampling"),
    ("generate", [], "sampling"),
    ("pipeline", [], "serving.sampling"),
    ("pipeline", [], "serving.report_sampling"),
    ("pipeline", ["serving=sampling"], "serving.sampling"),
    ("pipeline", ["serving=sampling"], "serving.report_sampling"),
]
# Parents under which a key named like a sampling setting is not the sampling spec.
NOT_SAMPLING = {"loss"}  # loss.temperature: the distillation loss's temperature


def _compose(name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name=name, overrides=["pair=toy-tiny", *overrides])
    OmegaConf.resolve(cfg)
    return cfg


@pytest.mark.parametrize(("name", "overrides", "path"), PLACES)
def test_every_place_holds_the_one_spec(name, overrides, path):
    node = OmegaConf.select(_compose(name, overrides), path)
    assert isinstance(node, DictConfig) and set(node) == set(KEYS), (name, path)
    Sampling.from_node(node, path)


def _stray(node: Any, path: str = "") -> list[str]:
    """Dotted paths of sampling-like keys outside a `{temperature, top_k, top_p}` node."""
    if not isinstance(node, DictConfig):
        return []
    out = []
    is_spec = set(node) == set(KEYS)
    for key, value in node.items_ex(resolve=False):
        here = f"{path}{key}"
        if key in (*KEYS, "do_sample") and not is_spec and path.rstrip(".") not in NOT_SAMPLING:
            out.append(here)
        out += _stray(value, here + ".")
    return out


@pytest.mark.parametrize(
    "name", ["validate", "online", "distill", "generate", "pipeline", "export"]
)
def test_no_stage_spells_sampling_key_by_key(name):
    assert _stray(_compose(name, [])) == []


def test_the_pipeline_hands_each_stage_one_spec():
    """What serving=sampling writes into each stage: whole spec nodes, not per-key overrides,
    as typed values (a checked Sampling's dict), not override strings."""
    from specdistill.distill.pipeline.plan import serving_overrides

    cfg = _compose("pipeline", ["serving=sampling", "serving.sampling.top_p=0.9"])
    overrides = serving_overrides(cfg)
    spec = {"temperature": 1.0, "top_k": 0, "top_p": 0.9}
    assert overrides["validate"].values["decoder.sampling"] == spec
    assert overrides["online"].values["decoder.sampling"] == spec
    assert overrides["distill"].values["eval.sampling"] == spec
    assert overrides["generate"].values == {
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    }
    assert overrides["generate"].groups == ()
    keys = [k for v in overrides.values() for k in v.values]
    stray = [k for k in keys if k.rsplit(".", 1)[-1] in (*KEYS, "do_sample")]
    assert stray == ["loss.temperature"]  # the loss's own temperature, not a sampling spec


def test_a_stage_spec_key_from_the_pipeline_cli_wins_and_old_keys_are_named():
    """`specdistill validate.decoder.sampling.top_p=0.5` (conf/README.md) sets one key of the
    spec the serving mode wrote; a per-key spelling from before the spec is refused by name."""
    from specdistill.distill.compose import compose_stage
    from specdistill.distill.pipeline.plan import serving_overrides
    from specdistill.distill.pipeline.stage import stage_keys_addable

    def stage_cfg(*argv: str) -> DictConfig:
        overrides = ["pair=toy-tiny", *stage_keys_addable(list(argv))]
        cfg = compose(config_name="pipeline", overrides=overrides)
        return compose_stage("validate", cfg, serving_overrides(cfg)["validate"])

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        val = stage_cfg("serving=sampling", "serving.sampling.temperature=0.7",
                        "validate.decoder.sampling.top_p=0.5")  # fmt: skip
        assert Sampling.from_node(val.decoder.sampling, "x") == Sampling(0.7, 0, 0.5)
        with pytest.raises(ConfigError, match=r"^validate: .*temperature"):
            stage_cfg("validate.decoder.temperature=1")


# --- bad values: exit 2 and one line naming the field, per stage CLI -----------------------


def _main(stage: str):
    if stage == "generate":
        from specdistill.data.generate.stage import main
    elif stage == "validate":
        from specdistill.decode.validate.stage import main
    elif stage == "distill":
        from specdistill.distill.train.stage import main
    elif stage == "online":
        from specdistill.distill.online.stage import main
    else:
        from specdistill.distill.pipeline.stage import main
    return main


CLI_CASES = [
    ("generate", ["sampling.top_p=1.5"], "sampling.top_p=1.5"),
    ("generate", ["sampling.top_k=-3"], "sampling.top_k=-3"),
    ("validate", ["decoder.sampling.temperature=-1"], "decoder.sampling.temperature=-1.0"),
    ("validate", ["decoder=sampling", "decoder.sampling.top_k=-2"], "decoder.sampling.top_k=-2"),
    ("validate", ["other_sampling.temperature=0"], "other_sampling.temperature=0"),
    ("validate", ["other_sampling.top_p=0"], "other_sampling.top_p=0.0"),
    ("online", ["decoder.sampling.top_p=0"], "decoder.sampling.top_p=0.0"),
    ("distill", ["eval.sampling.top_p=0"], "eval.sampling.top_p=0.0"),
    ("distill", ["onpolicy.sampling.temperature=-1"], "onpolicy.sampling.temperature=-1.0"),
    (
        "pipeline",
        ["serving=sampling", "serving.sampling.temperature=0"],
        "serving.sampling.temperature=0.0",
    ),
    ("pipeline", ["serving.sampling.top_p=2"], "serving.sampling.top_p=2.0"),
    # the per-key spellings the spec replaced, added the way Hydra's own message suggests
    ("generate", ["+do_sample=true"], "do_sample was replaced"),
    ("validate", ["+decoder.temperature=0.7"], "decoder.temperature was removed"),
    ("distill", ["+eval.top_p=0.9"], "eval.top_p was replaced"),
    ("pipeline", ["+serving.temperature=0.7"], "serving.temperature was replaced"),
]


@pytest.mark.parametrize(("stage", "overrides", "field"), CLI_CASES)
def test_cli_bad_sampling_is_exit_2_and_one_line(
    stage, overrides, field, toy_tiny, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # Hydra's run folder, for configs that leave it at its default
    out = f"run_dir={tmp_path}/run" if stage == "pipeline" else f"output_dir={tmp_path}/out"
    argv = [stage, "pair=toy-tiny", out, *overrides]
    if stage == "distill":
        argv.append("logger=none")
    code, err = main_in_process(_main(stage), argv, monkeypatch, capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"error: {field}"), err


# --- the generate stage: the spec in, the same record out ---------------------------------


def test_generate_record_keeps_its_layout_and_fingerprint(tmp_path):
    """generation_config.json's `sampling` is written as before the one spec, so a Seq-KD run
    made then still matches its fingerprint and resumes (greedy: neutral 1 / 0 / 1)."""
    from specdistill.data.generate.settings import GenerateSettings
    from tests.data.conftest import compose_generate

    def check_settings(cfg):
        return GenerateSettings.from_cfg(cfg).generation

    greedy = check_settings(compose_generate(tmp_path)).record()
    assert greedy == {"max_new_tokens": 6, "do_sample": False, "temperature": 1.0,
                      "top_p": 1.0, "top_k": 0, "num_samples": 1, "seed": 0}  # fmt: skip
    args = ("sampling.temperature=0.7", "sampling.top_p=0.9", "num_samples=2")
    sampled = check_settings(compose_generate(tmp_path, *args)).record()
    assert sampled == {"max_new_tokens": 6, "do_sample": True, "temperature": 0.7,
                       "top_p": 0.9, "top_k": 0, "num_samples": 2, "seed": 0}  # fmt: skip
    with pytest.raises(ConfigError, match=r"num_samples=2 with sampling\.temperature=0"):
        check_settings(compose_generate(tmp_path, "num_samples=2"))


def test_vllm_sampling_params_follow_the_spec(monkeypatch):
    """backend=vllm: the same settings become SamplingParams (a stand-in `vllm` module here;
    the real engine runs under `pytest -m vllm`)."""
    import sys
    import types

    from specdistill.data.generate import vllm_engine
    from specdistill.data.generate.batched import GenerationSettings

    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)

    def params(sampling: Sampling, seed: int | None) -> dict:
        s = GenerationSettings(
            max_new_tokens=8, sampling=sampling, num_samples=1, seed=0, sampled_share=1.0
        )
        return vllm_engine.sampling_params(s, [2], 0, seed)

    greedy = params(Sampling(), None)
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and greedy["max_tokens"] == 8
    hot = params(Sampling(0.7, 50, 0.9), 11)
    assert (hot["temperature"], hot["top_k"], hot["top_p"], hot["seed"]) == (0.7, 50, 0.9, 11)


class _MainProcess:
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def test_distill_hands_its_generate_settings_over_whole(tmp_path, monkeypatch):
    """`data.generate.sampling` reaches the generate stage as a node; an unknown key is named."""
    from specdistill.data.generate import stage as generate_stage
    from specdistill.distill.train import sources
    from specdistill.distill.train.settings import TrainSettings
    from tests.distill.conftest import _distill_cfg

    seen: list[DictConfig] = []
    monkeypatch.setattr(generate_stage, "run", seen.append)
    cfg = _distill_cfg(tmp_path, "data.generate.sampling.temperature=0.8")
    sources.build_seqkd(TrainSettings.from_cfg(cfg), cfg, _MainProcess())
    gcfg = seen[0]
    assert Sampling.from_node(gcfg.sampling, "sampling") == Sampling(0.8)
    assert (gcfg.max_new_tokens, gcfg.split, gcfg.topk_logprobs) == (64, "train", 0)
    with pytest.raises(ConfigError, match=r"^data\.generate: .*bogus"):
        bad = _distill_cfg(tmp_path, "+data.generate.bogus=1")
        sources.build_seqkd(TrainSettings.from_cfg(bad), bad, _MainProcess())


# --- distill on-policy batches follow onpolicy.sampling -----------------------------------


def test_onpolicy_samples_follow_the_spec():
    from specdistill.distill.train.data import Example
    from specdistill.distill.train.onpolicy import sample_onpolicy

    model = tiny_llama(vocab=32)
    exs = [Example([3, 4, 5], [6]), Example([7, 8], [9])]

    def draw(sampling: Sampling, seed: int) -> list[list[int]]:
        out = sample_onpolicy(model, exs, pad_id=0, eos_id=None, max_new_tokens=6,
                              sampling=sampling, seed=seed)  # fmt: skip
        return [e.completion_ids for e in out]

    greedy = draw(Sampling(), 0)
    assert greedy == draw(Sampling(), 1)  # temperature 0: the drafter's argmax, seed-free
    with torch.no_grad():
        ref = model.generate(torch.tensor([[3, 4, 5]]), do_sample=False, max_new_tokens=6)
    assert greedy[0] == ref[0, 3:].tolist()
    hot = Sampling(temperature=5.0)
    assert draw(hot, 0) == draw(hot, 0) and draw(hot, 0) != greedy  # seeded, and it samples
    top1 = Sampling(temperature=5.0, top_k=1)  # top-k 1 leaves only the argmax
    assert draw(top1, 0) == greedy
