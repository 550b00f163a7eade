"""Sliding-window caches roll back correctly: greedy stays token-identical to the target's own
cache-free greedy decoding when the window is far shorter than prompt + new tokens.

p = target, q = drafter (the target's first two layers, so acceptance is partial). Covers every
sliding layer (Mistral), a global first layer then sliding ones (Qwen2 `use_sliding_window`),
alternating local/global (Gemma 2), and local layers with a global last layer (Gemma 3), each
with the dynamic and the static cache, batch 1 and left-padded batches with uneven acceptance.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.cache import rollback_problem
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate.timing import step_costs
from tests.decode.sliding_models import FACTORIES, WINDOW
from tests.decode.test_speculative import greedy_reference, left_pad, prompts


def first_layers(model, n: int = 2):
    """A drafter sharing the target's embeddings and first `n` layers (their cache kinds too)."""
    d = copy.deepcopy(model)
    d.model.layers = d.model.layers[:n]
    d.config.num_hidden_layers = n
    if getattr(d.config, "layer_types", None) is not None:
        d.config.layer_types = d.config.layer_types[:n]
    return d


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def pair(request):
    target = FACTORIES[request.param]().eval()
    return request.param, target, first_layers(target)


NEW = 20  # with prompts of up to 12 tokens every decode runs far past WINDOW


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_greedy_lossless_batch1(pair, cache):
    _, target, drafter = pair
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=3, max_new_tokens=NEW, cache=cache)
    )
    drafted = accepted = 0
    for prompt in prompts(3, 64, seed=4):
        assert len(prompt) + NEW > 2 * WINDOW
        ids = torch.tensor([prompt])
        out = dec.generate(ids)
        assert out.tokens[0] == greedy_reference(target, prompt, NEW)
        assert dec.baseline(ids).tokens == out.tokens
        drafted += out.drafter_forwards
        accepted += out.accepted
    assert 0 < accepted < drafted  # rejections happened past the window: rollbacks were needed


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_sliding_greedy_lossless_batched(pair, cache, gamma):
    _, target, drafter = pair
    cfg = DecoderConfig(gamma=gamma, max_new_tokens=NEW, cache=cache)
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(4, 64, seed=30 + gamma)
    ids, mask = left_pad(rows)
    want = [greedy_reference(target, r, NEW) for r in rows]
    out = dec.generate(ids, mask)
    assert out.tokens == want
    assert dec.baseline(ids, mask).tokens == want
    assert out.accepted < out.trials  # rows left holes: the window is counted in real tokens


def test_sliding_step_costs_roll_back_past_the_window(pair):
    """`step_costs` (validate's c and verify cost) runs and rolls back both models' caches at a
    context 4x the window; a decode afterwards is still token-identical."""
    _, target, drafter = pair
    for cache in ("dynamic", "static"):
        dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=4, cache=cache))
        row = prompts(2, 64, seed=1)[1] * 2  # 24 tokens: 4x the window
        c, verify = step_costs(dec, torch.tensor([row]), iters=2, gamma=4)
        assert c > 0 and verify > 0
        want = greedy_reference(target, row, DecoderConfig().max_new_tokens)
        assert dec.generate(torch.tensor([row])).tokens[0] == want


def test_uncroppable_caches_are_refused_with_one_line():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    assert "linear_attention" in rollback_problem(cfg)
    chunked = LlamaConfig(num_hidden_layers=2, attention_chunk_size=8)
    assert "chunked_attention" in rollback_problem(chunked)
    assert rollback_problem(FACTORIES["gemma2"]()) is None

    from transformers import MambaConfig, MambaForCausalLM

    target = FACTORIES["mistral"]().eval()
    mamba = MambaForCausalLM(
        MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1)
    ).eval()
    with pytest.raises(ConfigError, match=r"^pair\.drafter=.*\(mamba\).*recurrent") as err:
        SpeculativeDecoder(target, mamba, DecoderConfig())
    assert "\n" not in str(err.value)


def test_uncroppable_checkpoint_is_refused_before_loading(tmp_path):
    from transformers import LlamaConfig

    from specdistill.decode.cache import check_rollback_config

    LlamaConfig(num_hidden_layers=2, attention_chunk_size=8).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^pair\.target=.*\(llama\).*chunked_attention"):
        check_rollback_config("pair.target", str(tmp_path), None, False)
    check_rollback_config("pair.target", str(tmp_path / "missing"), None, False)  # loader's job
