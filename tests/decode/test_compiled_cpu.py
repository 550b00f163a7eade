"""Compiled static-cache decode steps on CPU (inductor): still lossless, batch 1 and batched.

p = target, q = drafter. Slow: inductor compiles one graph per step shape (about a minute each on
a shared 2-core machine); the compiled functions are reused across prompts (bucketed capacity).
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.sliding_models import gemma2
from tests.decode.test_sliding_window import first_layers
from tests.decode.test_speculative import greedy_reference, left_pad, prompts


def test_compile_true_needs_a_static_cache():
    target = tiny_llama(vocab=64, layers=1)
    with pytest.raises(ConfigError, match=r"decoder\.cache=static"):
        SpeculativeDecoder(target, target, DecoderConfig(compile=True, cache="dynamic"))
    with pytest.raises(ConfigError, match=r"decoder\.compile"):
        SpeculativeDecoder(target, target, DecoderConfig(compile="yes"))
    dec = SpeculativeDecoder(target, target, DecoderConfig(compile=True))
    assert dec.static and dec.compile  # cache=auto follows compile on CPU
    assert not SpeculativeDecoder(target, target, DecoderConfig()).compile  # CPU default: eager


def test_compile_drafter_compiles_only_the_drafter_steps():
    target = tiny_llama(vocab=64, layers=2, seed=0)
    drafter = tiny_llama(vocab=64, layers=1, seed=1)
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(compile="drafter"))
    assert dec.compile and not dec.compile_target and not dec.static  # CPU auto: target dynamic
    t, d = dec._runner(target, 70), dec._runner(drafter, 70)
    assert t._step == t._eager and d._step != d._eager  # the baseline's target stays eager
    assert (t.static, t.capacity, d.static, d.capacity) == (False, 70, True, 256)
    assert dec._draft_width([[1] * 62], [False]) == 1  # the verify width may follow the budget
    full = SpeculativeDecoder(target, drafter, DecoderConfig(compile=True, max_new_tokens=64))
    assert full.compile_target and full._draft_width([[1] * 62], [False]) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "compile"), [("llama", True), ("gemma2", True), ("llama", "drafter")]
)
def test_cpu_compiled_greedy_is_lossless(make, compile):
    if make == "llama":
        target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    else:
        target = gemma2().eval()
    drafter = first_layers(target, 2)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=3, max_new_tokens=20, compile=compile)
    )
    assert dec.compile and dec.compile_target == dec.static == (compile is True)
    for prompt in prompts(3, 64, seed=2):
        ids = torch.tensor([prompt])
        want = greedy_reference(target, prompt, 20)
        assert dec.generate(ids).tokens[0] == want
        assert dec.baseline(ids).tokens[0] == want
    rows = prompts(4, 64, seed=8)
    ids, mask = left_pad(rows)
    want = [greedy_reference(target, r, 20) for r in rows]
    assert dec.generate(ids, mask).tokens == want
    assert dec.baseline(ids, mask).tokens == want


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "knob", "values"),
    [("confidence", "p_min", (0.0, 0.0197)), ("heuristic", "gamma", (1, 4))],
)
def test_cpu_compiled_adaptive_draft_length_is_lossless(policy, knob, values):
    """Varying lengths with compiled steps: verifies padded to a few widths, plain target steps
    (a confidence round with no confident draft) and power-of-two drafter catch-ups, batch 1
    and batched. (This random drafter's top q lies near 1/64: p_min 0.0197 stops rounds at
    every length, 0 included; 0.0 never stops.)"""
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    drafter = first_layers(target, 2)
    used = set()  # the draft lengths the decodes verified
    for value in values:
        cfg = DecoderConfig(
            max_new_tokens=20, compile=True, draft_length=policy, max_draft=4, **{knob: value}
        )
        dec = SpeculativeDecoder(target, drafter, cfg)
        assert dec.compile_target and len(dec.verify_widths) > 1
        for prompt in prompts(3, 64, seed=2):
            ids = torch.tensor([prompt])
            out = dec.generate(ids)
            assert out.tokens[0] == greedy_reference(target, prompt, 20)
            used |= {k for k, n in enumerate(out.draft_lengths) if n}
        rows = prompts(4, 64, seed=8)
        ids, mask = left_pad(rows)
        out = dec.generate(ids, mask)
        assert out.tokens == [greedy_reference(target, r, 20) for r in rows]
        used |= {k for k, n in enumerate(out.draft_lengths) if n}
    assert len(used) > 2  # several verify widths ran, not one fixed shape
