"""CUDA fast path (static caches, compiled/CUDA-graph decode steps): lossless in fp32, runs in bf16.

Marked `gpu`: skipped without a CUDA device (this project's CI and CPU machines).
"""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [1, 4])
def test_cuda_static_compiled_greedy_is_lossless(gamma):
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0).cuda()
    drafter = truncated_copy(target)
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=gamma, max_new_tokens=24))
    assert dec.static and dec.compile
    for prompt in prompts(3, 64, seed=gamma):
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
    rows = prompts(4, 64, seed=9)
    ids, mask = left_pad(rows)
    assert dec.generate(ids, mask).tokens == [greedy_reference(target, r, 24) for r in rows]


@pytest.mark.gpu
def test_cuda_bf16_runs_and_mostly_agrees():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0).cuda().to(torch.bfloat16)
    drafter = truncated_copy(target)
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=4, max_new_tokens=24))
    ids = torch.tensor([prompts(1, 64, seed=1)[0]])
    spec, base = dec.generate(ids).tokens[0], dec.baseline(ids).tokens[0]
    assert len(spec) == len(base) == 24
    assert spec[:4] == base[:4]  # bf16 near-ties may differ later; the report flags them


@pytest.mark.gpu
def test_cuda_long_decode_compiles_nothing_after_warm_up():
    """Compiled steps are reused for every token: after warm-up, a long decode (baseline and
    speculative, two prompts of different lengths in one capacity bucket) compiles no graph."""
    from torch._dynamo.utils import counters

    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0).cuda()
    drafter = truncated_copy(target)
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=4, max_new_tokens=160))
    first, second = (torch.tensor([p]) for p in prompts(2, 64, seed=3))
    dec.warm_up(first)
    dec.baseline(first), dec.generate(first)
    before = counters["stats"]["unique_graphs"]
    for ids in (first, second[:, :-3]):
        assert len(dec.generate(ids).tokens[0]) == 160
        assert len(dec.baseline(ids).tokens[0]) == 160
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.gpu
def test_cuda_sampling_with_the_stages_host_generator():
    """The stages seed one CPU generator per run; a CUDA decode at T=1 draws from its
    companion generator on the GPU (a CPU generator in a CUDA draw failed every T=1 decode on
    an H100). Same host seed, same tokens; target-only and speculative both run."""
    from specdistill.data.sampling import Sampling

    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0).cuda()
    drafter = truncated_copy(target)
    cfg = DecoderConfig(gamma=3, max_new_tokens=16, sampling=Sampling(1.0), compile=False)
    dec = SpeculativeDecoder(target, drafter, cfg)
    ids = torch.tensor([prompts(1, 64, seed=2)[0]])
    runs = [
        (dec.generate(ids, generator=torch.Generator().manual_seed(5)).tokens[0],
         dec.baseline(ids, generator=torch.Generator().manual_seed(5)).tokens[0])
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1] and all(len(t) == 16 for t in runs[0])


@pytest.mark.gpu
def test_cuda_first_draft_agreement_reads_host_prompts():
    """The parallel bench's probe feeds the host-side prompt rows to CUDA models."""
    from specdistill.decode.bench.draft import first_draft_agreement

    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0).cuda()
    ids, mask = left_pad(prompts(2, 64, seed=4))
    cont = [greedy_reference(target, row, 6) for row in prompts(2, 64, seed=4)]
    assert first_draft_agreement(target, target, [(ids, mask)], cont) == 1.0
