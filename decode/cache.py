"""One causal LM plus its KV cache, advanced and rolled back by position.

The speculative decoder keeps the target's (p) and the drafter's (q) caches in one shared slot
layout: slot i of both caches holds the same token, a shared 2-D mask marks the slots a row may
attend to (left padding, and "holes" where one row rejected drafts another row kept), and
explicit position ids count only a row's real tokens. Rolling back is then a pure position
change: `DynamicCache.crop(-k)` or, for a preallocated `StaticCache`, moving its write pointer;
the prefix is never recomputed. With batch 1 and no padding the layout is dense, so the mask and
position ids are left to the model (less per-step overhead, and the shapes CUDA graphs want).
"""

from __future__ import annotations

import inspect
import logging

import torch

log = logging.getLogger(__name__)


class ModelRunner:
    """A model with a KV cache of `length` committed slots; `forward` appends, `rollback` drops."""

    def __init__(
        self,
        model,
        *,
        static: bool,
        capacity: int,
        compile_steps: bool = False,
    ) -> None:
        from transformers import DynamicCache, StaticCache

        self.model = model
        self.static = static
        self.capacity = capacity
        self.length = 0
        if static:
            self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        else:
            self.cache = DynamicCache(config=model.config)
        params = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in params
        self._eager = model.forward
        self._step = self._eager
        if compile_steps:
            # Only on CUDA: fixed-shape decode steps (1-token draft, (gamma+1)-token verify)
            # replayed as CUDA graphs over the static cache; prefill stays eager.
            self._step = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        keep: int = 0,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Logits of the last `keep` positions (0: all) after appending `ids` to the cache."""
        n = ids.shape[1]
        if self.length + n > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {self.length}+{n} slots > capacity {self.capacity}"
            )
        kwargs = {"logits_to_keep": keep} if self._keep_arg and keep else {}
        fn = self._eager if prefill else self._step
        out = fn(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.length += n
        logits = out.logits
        return logits if not keep or self._keep_arg else logits[:, -keep:]

    def rollback(self, new_length: int) -> None:
        """Forget every slot from `new_length` on (no recompute: a crop or a pointer move)."""
        drop = self.length - new_length
        if drop < 0:
            raise RuntimeError(f"cannot roll forward from {self.length} to {new_length}")
        if drop == 0:
            return
        if self.static:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(new_length)
        else:
            self.cache.crop(-drop)
        self.length = new_length


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
