"""Tiny random models whose caches have sliding-window layers (windows shorter than a decode).

p = target, q = drafter. Each factory returns a model of one cache kind; `window` is the
sliding window in tokens, kept far below prompt + new tokens so every test crosses it.
"""

from __future__ import annotations

import torch

WINDOW = 6


def _common(vocab: int, layers: int, hidden: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


def mistral(vocab=64, layers=3, hidden=32, seed=0, window=WINDOW):
    """Every layer sliding (Mistral v0.1 style)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(
        MistralConfig(sliding_window=window, **_common(vocab, layers, hidden))
    )


def qwen2(vocab=64, layers=3, hidden=32, seed=0, window=WINDOW):
    """`use_sliding_window`: layers from `max_window_layers` on slide, the first is global."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=1,
        **_common(vocab, layers, hidden),
    )
    return Qwen2ForCausalLM(cfg)


def gemma2(vocab=64, layers=3, hidden=32, seed=0, window=WINDOW):
    """Alternating local (sliding) / global layers, logit soft-capping."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(sliding_window=window, **_common(vocab, layers, hidden)))


def gemma3(vocab=64, layers=3, hidden=32, seed=0, window=WINDOW):
    """Gemma 3 text: local layers with their own RoPE base, a global layer last."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = Gemma3TextConfig(
        sliding_window=window, layer_types=types, **_common(vocab, layers, hidden)
    )
    return Gemma3ForCausalLM(cfg)


FACTORIES = {"mistral": mistral, "qwen2": qwen2, "gemma2": gemma2, "gemma3": gemma3}
