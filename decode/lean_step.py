"""Decode steps of a plain Llama-family model without `transformers`' per-call machinery.

A decode step of a small model is mostly overhead on CPU: `LlamaForCausalLM.forward` runs its
decorators (deprecation, config defaults, output capturing), builds a causal mask through
`create_causal_mask`, and calls every submodule through `nn.Module.__call__`; on the toy pair
that is about as long as the arithmetic of the drafter's step, so it set c (drafter step /
target step) more than the models' sizes did. `lean_forward` runs the same computation from the
same modules and weights (embedding, RMSNorms, projections, the model's own rotary embedding, the
cache's own layers, `transformers`' SDPA attention or the packed GQA one) with the mask built
directly from the decoder's slot mask, the modules looked up once per runner (`lean_plan`) and
the norms and rotations written out op for op (`rms_norm`, `rotary_tables`), and a dense step's
cos and sin sliced from a table of every position the cache can hold (`RotaryTable`): the same
bits as the model's forward computes them, fewer dispatches. Prefill keeps the model's own
forward (long, compute-bound; not worth a second path).

Only models whose forward is exactly that computation qualify (`lean_problem`): Llama, Mistral or
Qwen2 with SDPA attention, SiLU MLP, full attention in every layer, no tensor-parallel split;
anything else (sliding windows, other architectures, a forward wrapped on the instance by a hook
or a test) keeps `model.forward`. tests/decode/test_lean_step.py holds the two paths to equal logits.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

# Llama's decoder layer, or one whose only differences the modules carry (Qwen2: biased q/k/v
# projections; Mistral: a sliding window, refused below when set)
LEAN_TYPES = ("llama", "mistral", "qwen2")
# each type's own RMSNorm class, whose formula `rms_norm` writes out (a norm swapped for another
# class, e.g. by a quantisation or a test, keeps `model.forward`)
RMS_NORMS = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm"}


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
    norms = [inner.norm] + [
        getattr(layer, name, None)
        for layer in inner.layers
        for name in ("input_layernorm", "post_attention_layernorm")
    ]
    if not all(type(n).__name__ == RMS_NORMS[config.model_type] for n in norms):
        return "a norm other than the model type's own RMSNorm"
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


class LeanLayer(NamedTuple):
    """One decoder layer's modules, looked up once (`nn.Module.__getattr__` costs about a
    microsecond a call, and a step looked up some thirty a layer). Modules, not their weights:
    weights are read at each call, so in-place training and a patched `nn.Linear.forward` (the
    CPU linear layouts, decode.cpu_matmul) apply as they would through the model's forward."""

    in_norm: torch.nn.Module
    q: torch.nn.Linear
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Linear
    post_norm: torch.nn.Module
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    act: torch.nn.Module
    attn: torch.nn.Module


class LeanPlan(NamedTuple):
    """What `lean_forward` reads of a model, resolved once per `ModelRunner` (a decode's life):
    a module swapped into the model after that is not seen, so a runner is never kept across
    such a change."""

    embed: torch.nn.Embedding
    rotary: torch.nn.Module
    norm: torch.nn.Module
    layers: tuple[LeanLayer, ...]
    head_dim: int
    scaling: float


def lean_plan(model) -> LeanPlan:
    """The modules of a model `lean_problem` accepts, in the order `lean_forward` runs them."""
    inner = model.model
    layers = tuple(
        LeanLayer(
            layer.input_layernorm,
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.post_attention_layernorm,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
            layer.mlp.act_fn,
            layer.self_attn,
        )
        for layer in list(inner.layers)[: model.config.num_hidden_layers]
    )
    attn = layers[0].attn
    return LeanPlan(
        inner.embed_tokens, inner.rotary_emb, inner.norm, layers, attn.head_dim, attn.scaling
    )


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for the RMSNorm of Llama, Mistral and Qwen2 (the same formula, op for op, so
    the same bits), without its casts where x is float32 already (each cast is a dispatch)."""
    wide = x.dtype == torch.float32
    h = x if wide else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (h if wide else h.to(x.dtype))


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cos and sin (B, n, D) as (B, 1, n, D), sin with its first half negated, and D / 2: then
    `x * cos + x.roll(D / 2, -1) * sin'` is `apply_rotary_pos_emb`'s `x * cos + rotate_half(x) *
    sin` bit for bit (a negation is exact, wherever it is applied), in four ops a tensor instead
    of seven, with the tables built once a step instead of once a layer."""
    half = cos.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), -1), half


# rope types whose cos and sin depend on the position alone: `transformers`' `dynamic_rope_update`
# recomputes the frequencies of "dynamic" and "longrope" as a sequence grows, so those keep the
# per-step rotary forward
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class RotaryTable:
    """cos and half-negated sin (`rotary_tables`) of every position a runner's cache can hold,
    computed once by the model's own rotary embedding, so a dense step slices its rows instead of
    running that embedding (some fifteen dispatches a step: a twelfth of a toy drafter's step).

    The same bits as the per-step computation: every op of the embedding is elementwise (a
    product of the position and a frequency, a concat, cos and sin, the attention scaling, a
    cast), and an elementwise op's result for one position does not depend on which others share
    its call. Built in calls of a few thousand elements, under the size at which torch splits an
    elementwise op across threads. tests/decode/test_lean_step.py holds every row to the
    per-step output at several step widths."""

    def __init__(self, rotary: torch.nn.Module, like: torch.Tensor, capacity: int) -> None:
        dim = rotary.inv_freq.shape[-1] * 2
        rows = max(1, 4096 // dim)
        cos, sin = [], []
        for start in range(0, capacity, rows):
            pos = torch.arange(start, min(start + rows, capacity), device=like.device)[None]
            c, s = rotary.forward(like, pos)
            cos.append(c)
            sin.append(s)
        self.cos, self.sin, self.half = rotary_tables(torch.cat(cos, 1), torch.cat(sin, 1))
        self.capacity = capacity

    def rows(self, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin' (1, 1, n, D) of positions length .. length + n - 1."""
        return self.cos[:, :, length : length + n], self.sin[:, :, length : length + n]

    @staticmethod
    def shared(rotary: torch.nn.Module, like: torch.Tensor, capacity: int) -> RotaryTable:
        """The table of `rotary` in `like`'s dtype and device covering `capacity` positions,
        kept per rotary module: runners are made per decode, target-only decoding and the
        speculative decoder each make theirs, and a table computed afresh for each would cost
        every decode the same rows again. Rebuilt (to a power of two) when it is too short, or
        when the module's frequencies differ from the ones it was built from (changed in place,
        replaced, or cast with the model)."""
        freq, key = rotary.inv_freq, (like.dtype, like.device)
        held = _TABLES.get(rotary, {}).get(key)
        if held is not None and held[1].capacity >= capacity and _same(held[0], freq):
            return held[1]
        table = RotaryTable(rotary, like, max(256, 1 << (capacity - 1).bit_length()))
        _TABLES.setdefault(rotary, {})[key] = (freq.detach().clone(), table)
        return table


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


# rotary module -> {(dtype, device): (the frequencies it was built from, table)}
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rotary_table_problem(model) -> str | None:
    """Why a model's dense steps must run its rotary embedding each step, or None."""
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} changes with the sequence"
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return "no inv_freq buffer"
    return None


def lean_forward(
    model,
    plan: LeanPlan,
    cache,
    ids: torch.Tensor,
    mask2d: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    length: int,
    keep: int,
    packed: bool,
    table: RotaryTable | None = None,
) -> torch.Tensor:
    """Logits of the last `keep` positions (0: all) of `ids` (B, n) appended to `cache` at
    `length` slots: `model(input_ids=ids, attention_mask=mask2d, position_ids=position_ids,
    cache=cache, logits_to_keep=keep).logits`, computed layer by layer from `plan`
    (`lean_plan(model)`). `packed`: multi-token steps attend through `packed_gqa_attention` (as
    the runner's own forward does). `table`: a dense step's (no position_ids) cos and sin come
    from it when it reaches past the step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdistill.decode.cache_layers import packed_gqa_attention

    b, n = ids.shape
    x = plan.embed.forward(ids)
    if position_ids is None and table is not None and length + n <= table.capacity:
        (cos, sin), half = table.rows(length, n), table.half
    else:
        if position_ids is None:
            position_ids = torch.arange(length, length + n, device=ids.device)[None]
        cos, sin, half = rotary_tables(*plan.rotary.forward(x, position_ids))
    mask = causal_mask(mask2d, length, n, b, ids.device)
    attend = packed_gqa_attention if packed and n > 1 else sdpa_attention_forward
    shape, scaling = (b, n, -1, plan.head_dim), plan.scaling
    slots = cache.layers
    for i, layer in enumerate(plan.layers):
        h = rms_norm(layer.in_norm, x)
        q = layer.q.forward(h).view(shape).transpose(1, 2)
        k = layer.k.forward(h).view(shape).transpose(1, 2)
        v = layer.v.forward(h).view(shape).transpose(1, 2)
        q = q * cos + q.roll(half, -1) * sin
        k = k * cos + k.roll(half, -1) * sin
        k, v = slots[i].update(k, v)
        o, _ = attend(layer.attn, q, k, v, mask, dropout=0.0, scaling=scaling)
        x = x + layer.o.forward(o.reshape(b, n, -1).contiguous())
        h = rms_norm(layer.post_norm, x)
        x = x + layer.down.forward(layer.act(layer.gate.forward(h)) * layer.up.forward(h))
    x = rms_norm(plan.norm, x[:, -keep:] if 0 < keep < n else x)
    return model.get_output_embeddings()(x)
