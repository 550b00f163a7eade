"""Cache layers for long contexts, and the KV cache's size.

p = target, q = drafter. At long context a decode step's cost should grow only with the
attention over the context, never with re-work of it: `SlotLayer` writes in place where
`transformers`' `DynamicLayer` re-concatenates the whole history; `kv_cache_bytes` says what
the caches hold, from the config.
"""

from __future__ import annotations

import torch


def cache_layer_types(config) -> tuple[list[str], int | None]:
    """Per-layer cache types as `transformers` would build them, and the sliding window (or None)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == "sliding_attention"}
    if len(windows) > 1:
        return [*types, f"sliding windows of several sizes {sorted(windows)}"], None
    return list(types), next(iter(windows), None)


KV_FORMULA = "layers x 2 x kv_heads x head_dim x tokens x dtype bytes (from the config)"


def kv_cache_bytes(config, tokens: int, dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes of K and V the decoder's cache holds for `tokens` slots of `batch` rows, from the
    config alone (`KV_FORMULA`): every attention layer counts, sliding ones included, since
    here they keep their whole history so a rollback can restore it; dummy layers hold nothing.
    A static cache allocates its whole capacity: pass that as `tokens`."""
    text = config.get_text_config(decoder=True)
    types, _ = cache_layer_types(config)
    layers = sum(t != "dummy" for t in types)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers * 2 * kv_heads * head_dim * tokens * batch * dtype.itemsize


def cache_nbytes(cache) -> int:
    """Bytes of the K and V tensors a cache's layers hold now (a `SlotLayer` or `StaticLayer`
    counts its whole buffer, as allocated)."""
    total = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        buffers = getattr(layer, "_kv", None) or (layer.keys, layer.values)
        total += sum(x.nbytes for x in buffers)
    return total


def slot_layer(capacity: int):
    """A `SlotLayer` of `capacity` slots (the class is built on first use: importing
    `transformers` stays out of this module's import)."""
    global _SLOT_LAYER
    if _SLOT_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class SlotLayer(DynamicLayer):
            """A dynamic layer without the re-copy (`DynamicLayer.update` copies the whole
            history every step: quadratic over a decode). One buffer of `capacity` slots is
            allocated at the first write; `keys` / `values` are views of the slots in use, so
            attention spans exactly those and `crop` only shortens the views. Writing past
            the capacity grows the buffer (doubling, counted in `allocations`)."""

            def __init__(self, capacity: int) -> None:
                super().__init__()
                self.capacity = capacity
                self.allocations = 0  # buffers allocated: 1 for a decode that fits its runner

            def lazy_initialization(self, key_states, value_states) -> None:
                self.device = key_states.device
                self._kv = self._allocate(key_states, value_states, self.capacity)
                self._view(0)
                self.is_initialized = True

            def _allocate(self, key_states, value_states, slots: int):
                self.allocations += 1
                return tuple(
                    x.new_empty((*x.shape[:2], slots, x.shape[3]))
                    for x in (key_states, value_states)
                )

            def _view(self, length: int) -> None:
                self.keys = self._kv[0][:, :, :length]
                self.values = self._kv[1][:, :, :length]

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                start = self.keys.shape[-2]
                end = start + key_states.shape[-2]
                if end > self._kv[0].shape[-2]:  # past the planned capacity: double it
                    grown = self._allocate(key_states, value_states, max(end, 2 * start))
                    for new, old in zip(grown, self._kv):
                        new[:, :, :start].copy_(old[:, :, :start])
                    self._kv = grown
                self._kv[0][:, :, start:end].copy_(key_states)
                self._kv[1][:, :, start:end].copy_(value_states)
                self._view(end)
                return self.keys, self.values

            def crop(self, tokens_to_remove: int) -> None:
                if tokens_to_remove > 0:
                    raise ValueError(f"crop({tokens_to_remove}): pass minus the tokens to drop")
                if tokens_to_remove and self.is_initialized:
                    self._view(max(self.keys.shape[-2] + tokens_to_remove, 0))

        _SLOT_LAYER = SlotLayer
    return _SLOT_LAYER(capacity)


_SLOT_LAYER = None
