"""Online adaptation inside llama-server (engine=llamacpp): the learning signal from the engine's
tokens, the journal, the figures from the engine's counters, bad input before any model loads,
and (-m llamacpp, with a built llama-server) the served loop itself: greedy identity in every
window, swaps, a killed server and a killed stage losing and doubling no request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.distill.losses import distill_loss
from specdistill.distill.online import stage as online
from specdistill.distill.online.buffer import entry_from_tokens
from specdistill.distill.online.engine_settings import EngineSettings, check_served
from specdistill.distill.online.engines.base import Answer
from specdistill.distill.online.journal import Journal
from specdistill.distill.online.served_report import EngineWindow, identical
from specdistill.distill.online.update import buffer_loss

SERVED = [
    "engine=llamacpp",
    "pair=toy-tiny",
    "logger=none",
    "stream=[{dataset:toy-test,requests:4},{dataset:stdlib-mail,requests:4}]",
    "max_new_tokens=12",
    "window=2",
    "update_every=2",
    "update_steps=2",
    "guard_every=2",
    "guard_probe=1",
    "save_every=2",
    "plot=false",
    "device=cpu",
    "llamacpp.threads=1",
]


def served_cfg(out, *overrides):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="online", overrides=[*SERVED, f"output_dir={out}", *overrides])


def _completion(tokens, drafted=0, accepted=0, ms=10.0) -> Answer:
    """An answer as llama-server counts it: every round after the first token emits its
    accepted drafts and one token of the target's."""
    return Answer(tokens=list(tokens), drafted=drafted, accepted=accepted,
                  rounds=len(tokens) - 1 - accepted, decode_ms=ms, prompt_ms=1.0)  # fmt: skip


def test_the_engines_tokens_train_the_cross_entropy_on_them(toy_tiny_pair):
    """A served answer's positions: logits at P-1+j predict emitted token j; the stage's top-1
    forward KL there equals the cross-entropy on the target's tokens, by brute force."""
    _, drafter, tok = toy_tiny_pair
    prompt = tok("def add(a, b):\n    return", add_special_tokens=False).input_ids
    tokens = tok(" a + b\n\n", add_special_tokens=False).input_ids
    e = entry_from_tokens(7, prompt, tokens)
    assert e is not None and e.request == 7 and e.tokens == len(tokens)
    assert e.ids.tolist() == prompt + tokens
    assert e.positions.tolist() == list(range(len(prompt) - 1, len(prompt) - 1 + len(tokens)))
    assert entry_from_tokens(1, prompt, []) is None
    vocab = drafter.get_output_embeddings().weight.shape[0]
    loss = buffer_loss(drafter, [e], vocab=vocab, loss=_fkl(), pad_id=tok.pad_token_id)
    with torch.no_grad():
        logits = drafter(input_ids=e.ids[None].long()).logits[0]
    want = torch.nn.functional.cross_entropy(logits[e.positions], torch.tensor(tokens))
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)


def _fkl():
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": "fkl", "beta": 0.5})


def test_top1_fkl_is_the_full_fkl_against_a_one_hot_target():
    """The (K+1)-way loss with K = 1 and probability 1 on the token is the full-vocabulary
    forward KL against that one-hot p (its rest bucket is empty)."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(1, 5, 11, generator=g)
    labels = torch.randint(0, 11, (1, 5), generator=g)
    mask = torch.ones(1, 5, dtype=torch.bool)
    topk = distill_loss(student, mask, topk_ids=labels[..., None], topk_lp=torch.zeros(1, 5, 1),
                        divergence="fkl")  # fmt: skip
    one_hot = torch.full((1, 5, 11), -1e9).scatter(-1, labels[..., None], 0.0)
    full = distill_loss(student, mask, target_logits=one_hot, divergence="fkl")
    torch.testing.assert_close(topk, full, rtol=1e-5, atol=1e-6)


def test_the_journal_keeps_every_answer_and_cuts_a_torn_line(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.append("request", 0, {"answers": {}, "restarts": 0})
    j.append("update", 1, {"promoted": True})
    with open(j.path, "a") as f:
        f.write('{"kind": "request", "index": 1, "answ')  # killed mid-write
    again = Journal(j.path).load()
    assert set(again.requests) == {0} and set(again.updates) == {1}
    again.append("request", 1, {"answers": {}, "restarts": 0})
    assert set(Journal(j.path).load().requests) == {0, 1}
    lines = j.path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(x) for x in lines)


def test_window_figures_come_from_the_counters():
    """Acceptance and tau pooled over the window's requests, from the engine's counters."""
    w = EngineWindow(first_request=4)
    w.add({"adapted": _completion([1, 2, 3, 4, 5], 6, 3, 20.0),
           "frozen": _completion([1, 2, 3, 4, 5], 8, 0), "plain": _completion([1, 2, 3, 4, 5])},
          segment=1, restarts=1)  # fmt: skip
    w.add({"adapted": _completion([6, 7, 8], 2, 1, 10.0),
           "frozen": _completion([6, 7, 8], 4, 2), "plain": _completion([6, 7, 8])},
          segment=1, restarts=0)  # fmt: skip
    row = w.row(6, greedy=True)
    assert row["alpha_adapted"] == round(4 / 8, 4) and row["alpha_frozen"] == round(2 / 12, 4)
    # decode tokens 4 + 2, rounds (4 - 3) + (2 - 1)
    assert row["tau_adapted"] == 3.0 and row["tokens_per_s_adapted"] == 200.0
    assert row["identical"] is True and row["restarts"] == 1 and row["segments"] == [1]
    assert EngineWindow.from_state(w.to_state()).row(6, True) == row


def test_identity_needs_greedy_and_a_plain_answer():
    got = {"adapted": [_completion([1, 2])], "frozen": [_completion([1, 2])],
           "plain": [_completion([1, 3])]}  # fmt: skip
    assert identical(got, greedy=True) is False
    assert identical(got, greedy=False) is None
    assert identical({**got, "plain": []}, greedy=True) is None


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("engine=sglang", "engine='sglang'"),
        ("loss=rkl", "loss.name=rkl with engine=llamacpp"),
        ("record=rejected", "record=rejected with engine=llamacpp"),
        ("batch_size=2", "batch_size=2 with engine=llamacpp"),
        ("llamacpp.drafter_type=q3_k", "llamacpp.drafter_type='q3_k'"),
        ("llamacpp.threads=0", "llamacpp.threads=0"),
        ("llamacpp.startup_timeout=0", "llamacpp.startup_timeout=0"),
        ("decoder.lookup=true", "engine=llamacpp verifies losslessly"),
    ],
)
def test_served_settings_refuse_what_the_engine_cannot_do(tmp_path, override, field):
    cfg = served_cfg(tmp_path, override, *(["window=2"] if "batch" not in override else
                                           ["window=2", "update_every=2", "guard_probe=2"]))  # fmt: skip
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("(", r"\(")):
        s = online.check_config(cfg)
        check_served(cfg, s, EngineSettings.from_cfg(cfg))


def test_engine_ours_keeps_the_stage_as_it_was(tmp_path):
    cfg = served_cfg(tmp_path, "engine=ours")
    e = EngineSettings.from_cfg(cfg)
    assert not e.served
    check_served(cfg, online.check_config(cfg), e)  # nothing refused for our own decoder


def test_a_missing_build_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch):
    from specdistill.decode.llamacpp import build

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(build.BINARY_ENV, raising=False)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("a model loaded before the refusal"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"engine=llamacpp: llama-server is not built"):
        online.run(served_cfg(tmp_path / "o"))


# ---------------------------------------------------------------- with a built llama-server


def _requests(out: Path) -> list[int]:
    """The request ids the journal holds, in order (a line being written is not counted)."""
    text = (out / "journal.jsonl").read_text()
    lines = [json.loads(x) for x in text.split("\n")[:-1]]
    return [r["index"] for r in lines if r["kind"] == "request"]


def _figures(rows: list[dict]) -> list[tuple]:
    """What a window measured that no timing changes."""
    keys = ("requests", "alpha_adapted", "alpha_frozen", "tau_adapted", "tau_frozen",
            "drafted_adapted", "accepted_adapted", "identical", "updates", "rollbacks", "swaps")  # fmt: skip
    return [tuple(r[k] for k in keys) for r in rows]


@pytest.fixture(scope="module")
def clean_run(llama_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "clean"
    return out, online.run(served_cfg(out))


@pytest.mark.llamacpp
def test_served_run_is_greedy_identical_and_swaps_the_drafter(clean_run):
    out, r = clean_run
    assert r.requests == 8 and r.identical is True
    rows = [json.loads(x) for x in (out / "online.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["identical"] is True for row in rows)
    assert r.updates == 4 and r.swaps + r.rollbacks <= r.updates and r.swaps >= 1
    assert r.swap_seconds_max is not None and r.swap_seconds_max < 30
    assert _requests(out) == list(range(8))  # each request asked once
    assert (out / "drafter" / "config.json").is_file() and (out / "online.md").is_file()
    assert r.restarts == 0 and r.replayed == 0


@pytest.mark.llamacpp
def test_a_killed_server_is_restarted_and_its_request_asked_once_more(clean_run, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    from specdistill.distill.online.served import Served

    asked = {"n": 0}
    real = Served.ask

    def ask(self, ids, n, s, seed):
        if self.name == "adapted":
            asked["n"] += 1
            if asked["n"] == 5:  # the server dies before the fifth request's answer
                os.kill(self.pid, signal.SIGKILL)
                self.server.process.wait()
        return real(self, ids, n, s, seed)

    monkeypatch.setattr(Served, "ask", ask)
    r = online.run(served_cfg(tmp_path / "o"))
    assert r.restarts == 1
    rows = [json.loads(x) for x in (tmp_path / "o" / "online.jsonl").read_text().splitlines()]
    clean = [json.loads(x) for x in (clean_run[0] / "online.jsonl").read_text().splitlines()]
    assert _figures(rows) == _figures(clean)  # the same answers as a run whose server lived
    assert _requests(tmp_path / "o") == list(range(8))


@pytest.mark.llamacpp
def test_a_killed_stage_resumes_without_losing_or_doubling_a_request(clean_run, tmp_path):
    out = tmp_path / "o"
    argv = [sys.executable, "-m", "specdistill.distill.online", *SERVED, f"output_dir={out}"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        journal = out / "journal.jsonl"
        if journal.is_file() and len(_requests(out)) >= 6:  # past the checkpoint at update 2
            proc.kill()
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (
        proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    )
    time.sleep(1.0)  # the servers get SIGTERM when their parent dies
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a llama-server outlived the killed stage"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["replayed"] >= 1 and result["resumed_same_drafter"] is True
    assert _requests(out) == list(range(8))  # none lost, none asked twice
    rows = [json.loads(x) for x in (out / "online.jsonl").read_text().splitlines()]
    clean = [json.loads(x) for x in (clean_run[0] / "online.jsonl").read_text().splitlines()]
    assert _figures(rows) == _figures(clean)


def test_a_request_log_is_a_stream_segment(tmp_path, toy_tiny_pair):
    """A user's log of an OpenAI-compatible server (completions: `prompt` and the `choices` it
    was served) streams its prompts as they were asked; the engine answers them again."""
    from specdistill.distill.online.stream import load_sources, parse_stream

    log_file = tmp_path / "requests.jsonl"
    rows = [
        {"model": "m", "prompt": "def add(a, b):\n    ", "choices": [{"text": "return a + b"}]},
        {"model": "m", "prompt": "import os\n", "choices": [{"text": "import sys"}]},
    ]
    log_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = {"source": "jsonl", "path": str(log_file), "format": "plain", "field": "prompt"}
    segments = parse_stream([{"dataset": ds, "requests": 4}])
    sources = load_sources(segments, None, toy_tiny_pair[2])
    (prompts,) = sources.values()
    assert [p.text for p in prompts] == [r["prompt"] for r in rows]


@pytest.mark.llamacpp
def test_sampled_serving_drafts_probabilistically_and_learns_from_samples(llama_server, tmp_path):
    """Temperature 1: the drafter proposes by llama.cpp's rejection sampling and learns from
    the target's sampled tokens; identity with the plain server is not asked of sampling."""
    out = tmp_path / "s"
    r = online.run(served_cfg(out, "decoder=sampling", "stream=[{dataset:toy-test,requests:4}]"))
    assert r.requests == 4 and r.decoder.startswith("sampling T=1.0") and r.identical is None
    journal = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    answers = [x["answers"]["adapted"] for x in journal if x["kind"] == "request"]
    assert len(answers) == 4 and all(a["drafted"] > 0 for a in answers)


def test_servers_draft_as_the_serving_mode_asks(tmp_path):
    """Greedy: llama.cpp's own greedy drafts; sampled: rejection sampling (probabilistic)."""
    from specdistill.distill.online.served import ServerSpec

    draft = tmp_path / "d.gguf"
    for path in (draft, tmp_path / "t.gguf"):
        path.write_bytes(b"GGUF")
    for method, want in ((None, None), ("probabilistic", "probabilistic")):
        spec = ServerSpec(binary=Path("llama-server"), target=tmp_path / "t.gguf", k=4, threads=1,
                          ctx=512, draft_sampling=method, startup_timeout=5.0,
                          log_dir=tmp_path)  # fmt: skip
        cmd = spec.server("adapted-0", draft).command(8080)
        assert cmd[cmd.index("--spec-draft-n-max") + 1] == "4"
        got = cmd[cmd.index("--spec-draft-sampling") + 1] if want else None
        assert got == want and ("--spec-draft-sampling" in cmd) == bool(want)
        assert "-md" not in spec.server("plain-0", None).command(8080)
