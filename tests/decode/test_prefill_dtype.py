"""`decoder.prefill_dtype=bf16`: a prompt's prefill runs under bf16 autocast, every decode step
and every cache slot stays in the model's dtype, and target-only and speculative decoding
(which share the prefill path) stay token-identical: the speedup compares like with like."""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.cache import ModelRunner, prefill_prompt
from specdistill.decode.config import DecoderSettings
from specdistill.decode.prefill_memo import PrefillMemo
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.sliding_models import mistral
from tests.decode.test_speculative import left_pad, truncated_copy


def recording_dtypes(model) -> list[tuple[int, torch.dtype]]:
    """(tokens fed, dtype of the first layer's MLP output) per forward of `model`."""
    seen: list[tuple[int, torch.dtype]] = []
    mlp = model.model.layers[0].mlp
    mlp.register_forward_hook(lambda m, args, out: seen.append((args[0].shape[1], out.dtype)))
    return seen


def test_a_bad_prefill_dtype_is_one_named_error():
    with pytest.raises(ConfigError, match=r"^decoder\.prefill_dtype='fp8': use model .* or bf16"):
        DecoderSettings.from_node({"prefill_dtype": "fp8"})
    assert DecoderSettings.from_node({}).prefill_dtype == "model"
    cfg = DecoderSettings.from_node({"prefill_dtype": "bf16"}).decoder_config(8, ())
    assert cfg.prefill_dtype == "bf16"


def test_the_prefill_runs_in_bf16_and_the_cache_and_steps_keep_fp32():
    model = tiny_llama(vocab=64, layers=2, hidden=32, seed=1)
    seen = recording_dtypes(model)
    prompt = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt, dtype=torch.bool)
    caches = {}
    for cast in (None, torch.bfloat16):
        runner = ModelRunner(model, static=False, capacity=20, prefill_cast=cast)
        t, _ = prefill_prompt([runner], prompt, mask, True)
        logits = runner.forward(t[:, None], keep=1)
        assert logits.dtype == torch.float32
        caches[cast] = [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]
        assert all(k.dtype == v.dtype == torch.float32 for k, v in caches[cast])
        assert type(runner.cache.layers[0]).update is runner.cache.layers[0].update.__func__
    # the model's own prefill, then a step; the bf16 prefill, then a step in fp32
    fed = prompt.shape[1] - 1
    assert seen == [
        (fed, torch.float32),
        (1, torch.float32),
        (fed, torch.bfloat16),
        (1, torch.float32),
    ]
    for (k32, v32), (k16, v16) in zip(caches[None], caches[torch.bfloat16]):
        assert not torch.equal(k32[:, :, :fed], k16[:, :, :fed])  # autocast did run
        torch.testing.assert_close(k16, k32, rtol=0.05, atol=0.05)
        torch.testing.assert_close(v16, v32, rtol=0.05, atol=0.05)
    # the step's own slot is written by an fp32 forward: bf16 rounding stays in the prompt's slots
    step_key = caches[torch.bfloat16][0][0][:, :, fed]
    assert not torch.equal(step_key, step_key.to(torch.bfloat16).float())


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
@pytest.mark.parametrize("length", ["fixed", "confidence"])
def test_greedy_speculative_equals_target_only_under_a_bf16_prefill(drafting, length):
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=2)
    drafter = truncated_copy(target, 1)
    extra = {"mask_token_id": 63} if drafting == "parallel" else {}
    cfg = DecoderConfig(
        gamma=3, max_new_tokens=16, lookup=False, prefill_dtype="bf16", drafting=drafting,
        draft_length=length, **extra,
    )  # fmt: skip
    dec = SpeculativeDecoder(target, drafter, cfg)
    gen = torch.Generator().manual_seed(4)
    for n in (5, 30, 61):
        prompt = torch.randint(1, 63, (1, n), generator=gen)
        assert dec.generate(prompt).tokens == dec.baseline(prompt).tokens


def test_batched_padded_and_sliding_window_prompts_stay_identical():
    """A masked (left-padded) batch prefill and a sliding-window target longer than its window:
    the autocast prefill's masks and windows work as the full-precision ones do."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    ids, mask = left_pad(rows)
    for target in (tiny_llama(vocab=64, layers=3, hidden=32, seed=3), mistral(seed=3)):
        cfg = DecoderConfig(gamma=3, max_new_tokens=14, lookup=False, prefill_dtype="bf16")
        dec = SpeculativeDecoder(target, truncated_copy(target, 1), cfg)
        assert dec.generate(ids, mask).tokens == dec.baseline(ids, mask).tokens
        for row in rows:  # batch 1 too (dense, no mask)
            one = torch.tensor([row])
            assert dec.generate(one).tokens == dec.baseline(one).tokens


def test_a_shared_memo_never_restores_a_cache_of_the_other_prefill_dtype():
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=6)
    drafter = truncated_copy(target, 1)
    memo = PrefillMemo()
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(7))
    outs = {}
    for dtype in ("model", "bf16", "model", "bf16"):
        cfg = DecoderConfig(gamma=2, max_new_tokens=8, lookup=False, prefill_dtype=dtype)
        dec = SpeculativeDecoder(target, drafter, cfg, prefill_memo=memo)
        outs.setdefault(dtype, []).append(dec.baseline(prompt).tokens)
    # one prefill run per setting (the target's), the repeats restored
    assert (memo.misses, memo.hits) == (2, 2)
    assert outs["model"][0] == outs["model"][1] and outs["bf16"][0] == outs["bf16"][1]


def test_a_bf16_prefill_off_cpu_and_cuda_is_refused_before_decoding():
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=8).to("meta")
    cfg = DecoderConfig(gamma=2, max_new_tokens=4, prefill_dtype="bf16")
    with pytest.raises(ConfigError, match=r"^decoder\.prefill_dtype=bf16: .* not meta; set "):
        SpeculativeDecoder(target, truncated_copy(target, 1), cfg)
    SpeculativeDecoder(target, truncated_copy(target, 1), DecoderConfig(gamma=2, max_new_tokens=4))
