"""Decode steps of a plain Llama-family model without `transformers`' per-call machinery.

A decode step of a small model is mostly overhead on CPU: `LlamaForCausalLM.forward` runs its
decorators (deprecation, config defaults, output capturing), builds a causal mask through
`create_causal_mask`, and calls every submodule through `nn.Module.__call__`; on the toy pair
that is about as long as the arithmetic of the drafter's step, so it set c (drafter step /
target step) more than the models' sizes did. `lean_forward` runs the same computation from the
same modules and weights (embedding, RMSNorms, projections, the model's own rotary embedding and
`apply_rotary_pos_emb`, the cache's own layers, `transformers`' SDPA attention or the packed
GQA one) with the mask built directly from the decoder's slot mask. Prefill keeps the model's own
forward (long, compute-bound; not worth a second path).

Only models whose forward is exactly that computation qualify (`lean_problem`): Llama, Mistral or
Qwen2 with SDPA attention, SiLU MLP, full attention in every layer, no tensor-parallel split;
anything else (sliding windows, other architectures, a forward wrapped on the instance by a hook
or a test) keeps `model.forward`. tests/decode/test_lean_step.py holds the two paths to equal logits.
"""

from __future__ import annotations

import torch

# Llama's decoder layer, or one whose only differences the modules carry (Qwen2: biased q/k/v
# projections; Mistral: a sliding window, refused below when set)
LEAN_TYPES = ("llama", "mistral", "qwen2")


def lean_problem(model, layers: tuple[list[str], int | None] | None = None) -> str | None:
    """Why `model`'s decode steps must run its own forward, or None when `lean_forward` computes
    exactly what it would. `layers`: `cache_layer_types(model.config)` where the caller has it
    already (a `ModelRunner` does; reading it costs more than the rest of the check)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in LEAN_TYPES:
        return f"not a {'/'.join(LEAN_TYPES)} model"
    if config._attn_implementation != "sdpa":
        return f"attention {config._attn_implementation!r}, not sdpa"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "a non-standard MLP"
    if layers is None:
        from specdistill.decode.cache_layers import cache_layer_types

        layers = cache_layer_types(config)
    types, window = layers
    if window is not None or any(t != "full_attention" for t in types):
        return "layers other than full attention"
    inner = getattr(model, "model", None)
    if inner is None or not all(
        hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        return "an unfamiliar module layout"
    return None


def causal_mask(
    mask2d: torch.Tensor | None, length: int, n: int, batch: int, device
) -> torch.Tensor | None:
    """Bool (B, 1, n, length + n), True = attend: slot j is visible to the step's i-th token when
    j <= length + i and the slot mask keeps j (left padding and rejected rows' holes are False).
    None for a 1-token step without a slot mask (it sees the whole cache)."""
    if mask2d is None and n == 1:
        return None
    width = length + n
    causal = torch.ones(n, width, dtype=torch.bool, device=device).tril(length)
    if mask2d is None:
        return causal.expand(batch, 1, n, width)
    return mask2d[:, None, None, :width].bool() & causal


def lean_forward(
    model,
    cache,
    ids: torch.Tensor,
    mask2d: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    length: int,
    keep: int,
    packed: bool,
) -> torch.Tensor:
    """Logits of the last `keep` positions (0: all) of `ids` (B, n) appended to `cache` at
    `length` slots: `model(input_ids=ids, attention_mask=mask2d, position_ids=position_ids,
    past_key_values=cache, logits_to_keep=keep).logits`, computed layer by layer. `packed`:
    multi-token steps attend through `packed_gqa_attention` (as the runner's own forward does)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from specdistill.decode.cache_layers import packed_gqa_attention

    inner = model.model
    b, n = ids.shape
    x = inner.embed_tokens.forward(ids)
    if position_ids is None:
        position_ids = torch.arange(length, length + n, device=ids.device)[None]
    cos, sin = inner.rotary_emb.forward(x, position_ids)
    mask = causal_mask(mask2d, length, n, b, ids.device)
    attend = packed_gqa_attention if packed and n > 1 else sdpa_attention_forward
    for i, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        h = layer.input_layernorm.forward(x)
        shape = (b, n, -1, attn.head_dim)
        q = attn.q_proj.forward(h).view(shape).transpose(1, 2)
        k = attn.k_proj.forward(h).view(shape).transpose(1, 2)
        v = attn.v_proj.forward(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.layers[i].update(k, v)
        o, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        x = x + attn.o_proj.forward(o.reshape(b, n, -1).contiguous())
        h = layer.post_attention_layernorm.forward(x)
        gate = mlp.act_fn(mlp.gate_proj.forward(h))
        x = x + mlp.down_proj.forward(gate * mlp.up_proj.forward(h))
    x = inner.norm.forward(x[:, -keep:] if keep else x)
    return model.get_output_embeddings()(x)
