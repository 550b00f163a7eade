"""On-policy rollouts through vLLM (distill/train/rollouts.py): which engine `onpolicy.engine`
means, what is refused before loading, and (-m vllm) that the engine follows the trained
weights: its greedy rollouts equal `generate`'s on the same weights, step after step."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.distill.train import rollouts
from specdistill.distill.train.example import Example
from specdistill.distill.train.onpolicy import sample_onpolicy
from tests.data.test_generate_vllm import vllm_model  # noqa: F401  (the fixture)


def test_which_engine_onpolicy_engine_means(monkeypatch):
    assert rollouts.resolve_engine("vllm", lmbda_used=False, cuda=True) == "transformers"
    assert rollouts.resolve_engine("transformers", True, True) == "transformers"
    assert rollouts.resolve_engine("auto", True, cuda=False) == "transformers"
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    assert rollouts.resolve_engine("auto", True, cuda=True) == "transformers"
    with pytest.raises(ConfigError, match=r"onpolicy.engine=vllm but vLLM is not installed"):
        rollouts.resolve_engine("vllm", True, cuda=False)
    with pytest.raises(ConfigError, match=r"onpolicy.engine='sglang': choose one of"):
        rollouts.resolve_engine("sglang", True, True)


def test_what_vllm_rollouts_cannot_serve_is_refused():
    rollouts.check_rollouts(zero_stage=2, mapped=False, parallel=False)
    for kw, why in (
        ({"zero_stage": 3, "mapped": False, "parallel": False}, "ZeRO-3"),
        ({"zero_stage": 0, "mapped": True, "parallel": False}, "its own tokenizer"),
        ({"zero_stage": 0, "mapped": False, "parallel": True}, "parallel drafter"),
    ):
        with pytest.raises(ConfigError, match=f"onpolicy.engine=vllm: .*{why}"):
            rollouts.check_rollouts(**kw)


def test_the_distill_stage_refuses_vllm_rollouts_before_loading(distill_cfg, tmp_path, monkeypatch):
    from specdistill.distill.train import stage, trainer

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(trainer, "load_role", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = distill_cfg(tmp_path / "run", "lmbda=0.5", "onpolicy.engine=vllm")
    with pytest.raises(ConfigError, match="onpolicy.engine=vllm but vLLM is not installed"):
        stage.prepare(cfg)


@pytest.mark.vllm
def test_vllm_rollouts_follow_the_trained_weights(vllm_model):  # noqa: F811
    path = str(vllm_model)
    spec = SimpleNamespace(drafter=path, drafter_revision=None, tokenizer=None, target=path,
                           trust_remote_code=False)  # fmt: skip
    roll = rollouts.VLLMRollouts.build(spec, "float32", 256, 8, seed=0)
    try:
        _follows_the_weights(roll, path)
    finally:
        roll.close()  # the engine's process group goes with it (the next test starts clean)


def _follows_the_weights(roll, path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["def add(a, b):\n", "import os\n", "class Point:\n    def"]
    exs = [Example(tok(t, add_special_tokens=False).input_ids, [0]) for t in texts]
    kw = dict(pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_new_tokens=12, seed=5)
    greedy = Sampling(temperature=0.0)
    for step in range(3):
        if step:  # an optimizer step's worth of change
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
        got = roll.sample(model, step, exs, sampling=greedy, **kw)
        want = sample_onpolicy(model, exs, sampling=greedy, **kw)
        assert [e.completion_ids for e in got] == [e.completion_ids for e in want], step
        assert roll.synced_step == step
    hot = Sampling(temperature=1.0)
    a = roll.sample(model, 2, exs, sampling=hot, **kw)
    b = roll.sample(model, 2, exs, sampling=hot, **kw)
    c = roll.sample(model, 2, exs, sampling=hot, **{**kw, "seed": 6})
    assert [e.completion_ids for e in a] == [e.completion_ids for e in b]
    assert [e.completion_ids for e in a] != [e.completion_ids for e in c]


@pytest.mark.vllm
def test_the_distill_stage_with_vllm_rollouts_trains_as_with_generate(
    vllm_model,  # noqa: F811
    distill_cfg,
    tmp_path,
):
    """Greedy on-policy batches (lmbda=1): vLLM's rollouts are `generate`'s, so both engines
    give the same losses step for step, and the run ends cleanly."""
    from specdistill.data.generate.vllm_engine import shutdown_engine
    from specdistill.distill.train import stage

    shutdown_engine()  # an earlier test's cached engine: a distill run ends the process group
    path = str(vllm_model)
    common = ("pair.toy=null", f"pair.target={path}", f"pair.drafter={path}", "lmbda=1.0",
              "onpolicy.sampling.temperature=0", "onpolicy.max_new_tokens=12",
              "data.seq_kd=false", "data.reference=true", "data.limit=16", "max_steps=3",
              "eval.limit=4", "freeze_embeddings=false")  # fmt: skip
    runs = {
        engine: stage.run(distill_cfg(tmp_path / engine, *common, f"onpolicy.engine={engine}"))
        for engine in ("transformers", "vllm")
    }
    losses = {e: [h["loss"] for h in r.history] for e, r in runs.items()}
    assert losses["vllm"] == pytest.approx(losses["transformers"], rel=1e-5, abs=1e-7)
    assert losses["vllm"][-1] > 0  # the drafter moved off the target it started as


@pytest.mark.vllm
def test_two_processes_with_vllm_rollouts_train_as_with_generate(vllm_model, tmp_path):  # noqa: F811
    """2 ranks under torchrun (gloo), each with its own engine built under the launcher
    (`external_launcher`), greedy on-policy batches only: the losses step for step are those
    of the same 2-process run with `generate`'s rollouts, and both ranks end cleanly."""
    import json
    import os
    import subprocess

    path = str(vllm_model)
    common = ["pair.toy=null", f"pair.target={path}", f"pair.drafter={path}", "lmbda=1.0",
              "onpolicy.sampling.temperature=0", "onpolicy.max_new_tokens=12",
              "data.seq_kd=false", "data.reference=true", "data.limit=16", "max_steps=3",
              "eval.limit=4", "freeze_embeddings=false", "micro_batch_size=2", "logger=none",
              "device=cpu"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    losses = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / engine
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "-m", "specdistill.distill.train", *common,
               f"onpolicy.engine={engine}", f"output_dir={out}"]  # fmt: skip
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads((out / "result.json").read_text())
        assert result["world_size"] == 2
        losses[engine] = [h["loss"] for h in result["history"]]
    assert losses["vllm"] == pytest.approx(losses["transformers"], rel=1e-5, abs=1e-7)
