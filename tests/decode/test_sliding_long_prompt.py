"""Greedy token identity on a prompt longer than a sliding window.

tests/decode/test_sliding_window.py crosses the window during decoding with prompts of at most
2x the window; here the PROMPT alone is 4x the window (64 tokens, window 16), so the prefill
already evicts, and the decoder's output must equal the target's own `generate` (greedy, its
own cache) and cache-free greedy decoding. p = target, q = drafter (the target's first layer).
"""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.decode.sliding_models import mistral, qwen2
from tests.decode.test_sliding_window import first_layers
from tests.decode.test_speculative import greedy_reference

WINDOW, PROMPT, NEW = 16, 64, 24


@pytest.mark.parametrize("make", [mistral, qwen2], ids=["mistral", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_prompt_four_windows_long_is_token_identical(make, cache):
    target = make(vocab=64, layers=2, seed=3, window=WINDOW).eval()
    drafter = first_layers(target, 1)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, 64, (1, PROMPT), generator=g)
    assert PROMPT >= 4 * WINDOW
    unwindowed = make(vocab=64, layers=2, seed=3, window=1 << 20).eval()
    unwindowed.load_state_dict(target.state_dict())
    with torch.no_grad():  # the window really cuts the prompt's attention (else no test)
        assert not torch.allclose(target(prompt).logits[0, -1], unwindowed(prompt).logits[0, -1])
    want = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
        min_new_tokens=NEW, pad_token_id=0,
    )[0, PROMPT:].tolist()  # fmt: skip
    assert want == greedy_reference(target, prompt[0].tolist(), NEW)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=3, max_new_tokens=NEW, cache=cache)
    )
    out = dec.generate(prompt)
    assert out.tokens[0] == want
    assert 0 < out.accepted < out.trials  # rejections after a long prefill: rollbacks happened
