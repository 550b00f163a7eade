"""vLLM generation streamed across chunks (`vllm_engine.stream_rows_vllm`), against a fake
engine core: the next chunks' requests join while earlier ones run (never more than the window
in flight), each chunk comes out once all its
requests finished, with exactly the rows (prompt-major, per-row seeds) that one `generate` call
per chunk gives. The real engine runs it in tests/data/test_generate_vllm.py (-m vllm)."""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field

import pytest

from specdistill.data.generate import vllm_engine as ve
from specdistill.data.generate.batched import GenerationSettings, PreparedPrompt
from specdistill.data.sampling import Sampling


@dataclass
class FakeParams:
    n: int = 1
    max_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)
    logprobs: int | None = None
    detokenize: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    output_kind: str = "CUMULATIVE"


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = FakeParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="FINAL_ONLY")
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sp)):
        monkeypatch.setitem(sys.modules, name, mod)


class FakeCore:
    """An engine core that runs `batch` requests a step, finishing them in a shuffled order
    after a random number of steps; like vLLM it returns an internal id of its own from
    add_request and names outputs by the caller's id."""

    def __init__(self, batch: int, seed: int = 0):
        self.batch, self.rng = batch, random.Random(seed)
        self.queue: list = []
        self.running: list = []
        self.peak = 0

    def add_request(self, rid, prompt, params):
        assert params.output_kind == "FINAL_ONLY"
        ids = prompt["prompt_token_ids"]
        # a completion that depends on the prompt and the row's seed only
        out = [(sum(ids) + (params.seed or 0) + i) % 50 + 3 for i in range(params.max_tokens)]
        self.queue.append([rid, out, self.rng.randint(1, 4)])
        self.peak = max(self.peak, len(self.queue) + len(self.running))
        return f"{rid}-internal"

    def step(self):
        while self.queue and len(self.running) < self.batch:
            self.running.append(self.queue.pop(0))
        done = []
        for r in self.running:
            r[2] -= 1
        for r in [r for r in self.running if r[2] <= 0]:
            self.running.remove(r)
            o = types.SimpleNamespace(token_ids=r[1], finish_reason="length", stop_reason=None,
                                      logprobs=None)  # fmt: skip
            done.append(types.SimpleNamespace(request_id=r[0], finished=True, outputs=[o]))
        self.rng.shuffle(done)
        return [*done, types.SimpleNamespace(request_id="other", finished=False, outputs=[])]


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _chunks(n_chunks: int, size: int):
    return [
        (k, [PreparedPrompt(k * size + i, f"p{k}-{i}", [k, i, 7]) for i in range(size)])
        for k in range(n_chunks)
    ]


@pytest.mark.parametrize("samples", [1, 2])
def test_chunks_stream_through_a_full_engine_with_the_rows_of_one_call_each(fake_vllm, samples):
    s = GenerationSettings(max_new_tokens=5, sampling=Sampling(temperature=1.0),
                           num_samples=samples, seed=3, sampled_share=1.0)  # fmt: skip
    chunks = _chunks(6, 4)
    core = FakeCore(batch=3)
    seen = []
    got = dict(
        ve.stream_rows_vllm(core, Tok(), chunks, s, 0, [2], lambda r, t: seen.append((r, t)), 6)
    )
    assert sorted(got) == list(range(6)) and len(seen) == 6
    assert core.peak <= 6 + 4 * samples  # the window, overshot by at most one chunk
    for k, prompts in chunks:
        rows = got[k]
        assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
            (p.index, j) for p in prompts for j in range(samples)
        ]
        for r, p in zip(rows, [p for p in prompts for _ in range(samples)]):
            seed = ve.row_seed(3, p.index, r["sample_index"])
            assert r["completion_ids"] == [(sum(p.ids) + seed + i) % 50 + 3 for i in range(5)]
    assert sum(r for r, _ in seen) == 6 * 4 * samples and all(t == r * 5 for r, t in seen)


def test_a_chunk_larger_than_the_window_still_runs(fake_vllm):
    s = GenerationSettings(
        max_new_tokens=2, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
    )
    got = list(ve.stream_rows_vllm(FakeCore(batch=2), Tok(), _chunks(2, 5), s, 0, [2],
                                   lambda r, t: None, 1))  # fmt: skip
    assert sorted(k for k, _ in got) == [0, 1] and all(len(rows) == 5 for _, rows in got)


def test_a_stream_stopped_early_aborts_what_it_left_running(fake_vllm):
    s = GenerationSettings(
        max_new_tokens=2, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
    )
    core = FakeCore(batch=2)
    aborted = []
    core.abort_request = aborted.extend
    stream = ve.stream_rows_vllm(core, Tok(), _chunks(4, 3), s, 0, [2], lambda r, t: None, 6)
    next(stream)
    stream.close()  # the caller died writing its first chunk
    assert aborted and not any(rid.endswith("internal") for rid in aborted)
    assert len(aborted) == len(set(aborted)) <= 6
