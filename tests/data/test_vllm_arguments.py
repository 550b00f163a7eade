"""`vllm.LLM`'s keyword arguments come from one builder (`vllm_engine.engine_arguments`).

The builder's output for each case a caller uses, then each caller (generate's `build_engine`,
which distill's on-policy rollouts also start their engine through, and validate's two engines)
run against a stand-in `vllm` module that records what `vllm.LLM` was given: the arguments each
passed before the builder existed, key for key. The real engines run under `pytest -m vllm`.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from specdistill.data.generate import vllm_engine as ve
from specdistill.data.models.pairs import PairSpec

SETTINGS = ve.EngineSettings(
    tensor_parallel_size=1,
    gpu_memory_utilization=0.9,
    max_num_seqs=16,
    max_model_len=None,
    enforce_eager=True,
    cpu_kvcache_gib=1.0,
    in_process=None,
)
SPEC = PairSpec(target="/m/target", drafter="/m/drafter", tokenizer="/m/tok", revision="r1")
# What every engine of the target is given (dtype, max_model_len and seed as the tests pass them)
COMMON = {
    "model": "/m/target",
    "tokenizer": "/m/tok",
    "revision": "r1",
    "trust_remote_code": False,
    "dtype": "bfloat16",
    "tensor_parallel_size": 1,
    "max_num_seqs": 16,
    "max_model_len": 96,
    "enforce_eager": True,
    "seed": 7,
}


def _arguments(**kw):
    base = {"dtype": "bfloat16", "max_model_len": 96, "seed": 7, "in_process": False}
    return ve.engine_arguments(SPEC, SETTINGS, **{**base, **kw})


def test_generate_engine_asks_raw_logprobs_at_least_vllms_cap():
    assert _arguments(topk=5) == {**COMMON, "gpu_memory_utilization": 0.9, "max_logprobs": 20,
                                  "logprobs_mode": "raw_logprobs"}  # fmt: skip
    assert _arguments(topk=0)["max_logprobs"] == 20
    assert _arguments(topk=32)["max_logprobs"] == 32


def test_the_executor_follows_where_the_engine_core_runs():
    """In process with one GPU a rank: `uni`; under the caller's launcher: `external_launcher`;
    a separate engine core, or tensor parallelism: vLLM's own choice (no key)."""
    assert "distributed_executor_backend" not in _arguments()
    assert _arguments(in_process=True)["distributed_executor_backend"] == "uni"
    launched = _arguments(in_process=True, external_launcher=True)
    assert launched["distributed_executor_backend"] == "external_launcher"
    tp2 = ve.engine_arguments(
        SPEC, ve.EngineSettings(2, 0.9, 16, None, True, 1.0, None),
        dtype="bfloat16", max_model_len=96, seed=7, in_process=True,
    )  # fmt: skip
    assert "distributed_executor_backend" not in tp2


def test_validate_engines_take_half_the_memory_keep_stats_and_may_draft():
    spec = {"model": "/m/drafter", "method": "draft_model", "num_speculative_tokens": 3}
    plain = _arguments(memory_share=0.5, stats=True)
    assert plain == {**COMMON, "gpu_memory_utilization": 0.45, "disable_log_stats": False}
    drafting = _arguments(memory_share=0.5, stats=True, speculative=spec)
    assert drafting == {**plain, "speculative_config": spec}
    assert "max_logprobs" not in drafting and "speculative_config" not in _arguments(topk=5)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` whose `LLM` records its keyword arguments; `on_cpu` picks the platform."""
    calls: list[dict] = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kwargs: calls.append(kwargs) or SimpleNamespace()
    vllm.__version__ = "0.32.0"
    platforms = types.ModuleType("vllm.platforms")
    platform = SimpleNamespace(on_cpu=True)
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: platform.on_cpu)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(ve, "_ENGINE", None)
    return calls, platform


def test_generate_and_rollout_engines_get_what_they_got_before(fake_vllm):
    calls, platform = fake_vllm
    ve.build_engine(SPEC, "bfloat16", SETTINGS, 96, 8, 7)
    generate = {**COMMON, "gpu_memory_utilization": 0.9, "max_logprobs": 20,
                "logprobs_mode": "raw_logprobs"}  # fmt: skip
    assert calls == [{**generate, "distributed_executor_backend": "uni"}]  # CPU: in process
    ve.build_engine(SPEC, "bfloat16", SETTINGS, 96, 8, 7)
    assert len(calls) == 1  # the same engine asked again: reused
    ve.shutdown_engine()
    platform.on_cpu = False  # a GPU: vLLM's separate engine core, its own executor
    ve.build_engine(SPEC, "bfloat16", SETTINGS, 96, 8, 7)
    assert calls[-1] == generate
    # distill's on-policy rollouts: one engine per rank under the training launcher
    ve.build_engine(SPEC, "bfloat16", SETTINGS, 96, 0, 7, external_launcher=True)
    assert calls[-1] == {**generate, "distributed_executor_backend": "external_launcher"}


def test_validate_two_engines_get_what_they_got_before(fake_vllm):
    from specdistill.decode.validate import vllm_engine as validate_engine

    calls, _ = fake_vllm
    with validate_engine.engines(
        SPEC, SETTINGS, dtype="bfloat16", max_model_len=96, seed=7, gamma=3, method="probabilistic"
    ):
        pass
    plain = {**COMMON, "gpu_memory_utilization": 0.45, "disable_log_stats": False,
             "distributed_executor_backend": "uni"}  # fmt: skip
    drafter = {"model": "/m/drafter", "method": "draft_model", "num_speculative_tokens": 3,
               "draft_sample_method": "probabilistic"}  # fmt: skip
    assert calls == [plain, {**plain, "speculative_config": drafter}]
