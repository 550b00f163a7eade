"""Prefill each prompt once per model: the KV cache of a prompt, kept and restored.

p = target, q = drafter. At long context a decode call is mostly its prefill (a prompt of
thousands of tokens against a few dozen new ones; figures: decode/RESULTS.md, "the real pair
by context length"). A validate run decodes every prompt many times (target-only and
speculative, `repeats` times, in both serving modes, fixed gamma beside an adaptive policy) and
times c at each bucket's prompt: re-running the same prefill each time more than doubled a
real-pair per-bucket run. A `PrefillMemo` runs and times each (model, prompt) prefill
once and restores its cache (a copy of K and V, bit-identical) on later calls.

The timing stays honest: a restored prefill reports the seconds its one real run took
(`Prefilled.seconds`) and how much of that this call did not spend (`Prefilled.saved`); the
validate stage adds `saved` back to its wall clock, so end-to-end figures still include one
measured prefill per decode, and decode-only figures are untouched.

Only caches written in place by position qualify (the eager path's `SlotLayer`s, any batch
layout): a static cache (compiled steps) prefills as before. Memory is bounded (`max_bytes`):
once full, new prompts prefill without being kept and the kept ones stay. Validate sweeps its
prompts in the same order every repeat, a cycle on which dropping the least recently used entry
would drop each one just before its reuse (decode/RESULTS.md, the real pair by context length).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdistill.decode.cache import ModelRunner, prompt_feed, sync

# a bucketed prompt set of a small pair; past it, new prompts are not kept
DEFAULT_MAX_BYTES = 8 << 30


class Prefilled(NamedTuple):
    """A prompt's prefill: the pending token and its position per row (as `prefill_prompt`
    returns them), the seconds the prefill costs (measured when it really ran) and the seconds
    this call saved by restoring it (0 when it ran)."""

    t: torch.Tensor
    pos: torch.Tensor
    seconds: float
    saved: float


@dataclass
class _Entry:
    model: object  # kept alive, so the id in the key cannot be reused by another model
    states: list[tuple[torch.Tensor, torch.Tensor] | None]  # per cache layer (None: empty)
    length: int
    seconds: float
    nbytes: int


class PrefillMemo:
    """Prefilled caches by (model, prefill dtype, fed prompt ids, their mask), kept while they fit in
    `max_bytes`. Hits and misses are counted (`hits`, `misses`) for reports and tests."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple, _Entry] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(runner: ModelRunner, fed: torch.Tensor, attn: torch.Tensor | None) -> tuple:
        mask = None if attn is None else attn.cpu().numpy().tobytes()
        # a prefill under autocast (`ModelRunner.prefill_cast`) writes another cache
        fed_bytes = fed.cpu().numpy().tobytes()
        return (id(runner.model), runner.prefill_cast, tuple(fed.shape), fed_bytes, mask)

    @staticmethod
    def qualifies(runner: ModelRunner) -> bool:
        """A fresh runner whose cache is written in place by position (not a static one)."""
        return not runner.static and runner.length == 0

    def run(
        self,
        runner: ModelRunner,
        fed: torch.Tensor,
        attn: torch.Tensor | None,
        pos: torch.Tensor | None,
    ) -> tuple[float, float]:
        """Prefill `runner` with `fed` (as `prefill_prompt` feeds it) or restore the cache from
        an earlier run: (seconds the prefill costs, seconds saved now)."""
        device = fed.device
        if not self.qualifies(runner):
            return _forward(runner, fed, attn, pos, device), 0.0
        key = self._key(runner, fed, attn)
        entry = self._entries.get(key)
        if entry is not None and entry.model is runner.model:
            self.hits += 1
            t0 = time.perf_counter()
            _restore(runner, entry)
            sync(device)
            return entry.seconds, max(entry.seconds - (time.perf_counter() - t0), 0.0)
        self.misses += 1
        seconds = _forward(runner, fed, attn, pos, device)
        self._store(key, runner, seconds)
        return seconds, 0.0

    def _store(self, key: tuple, runner: ModelRunner, seconds: float) -> None:
        states: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in runner.cache.layers:
            if getattr(layer, "is_initialized", False):
                states.append((layer.keys.clone(), layer.values.clone()))
            else:
                states.append(None)
        nbytes = sum(k.nbytes + v.nbytes for s in states if s is not None for k, v in [s])
        if self.nbytes + nbytes > self.max_bytes:
            return  # full: the kept prompts stay (see the module docstring)
        self._entries[key] = _Entry(runner.model, states, runner.length, seconds, nbytes)
        self.nbytes += nbytes


def _forward(runner: ModelRunner, fed, attn, pos, device) -> float:
    t0 = time.perf_counter()
    runner.forward(fed, attn, pos, keep=1, prefill=True)
    sync(device)
    return time.perf_counter() - t0


def _restore(runner: ModelRunner, entry: _Entry) -> None:
    """Write a stored prefix into a fresh runner's cache (its layers allocate their own
    capacity on the first write, as a prefill's forward would make them)."""
    for layer, state in zip(runner.cache.layers, entry.states):
        if state is not None:
            layer.update(*state)
    runner.length = entry.length
    runner._allocated = True


def prefill_timed(
    runner: ModelRunner,
    ids: torch.Tensor,
    mask: torch.Tensor,
    dense: bool,
    memo: PrefillMemo | None = None,
) -> Prefilled:
    """`prefill_prompt` for one runner, timed, through `memo` when given (see the module
    docstring): the prompt but its last token goes into the cache; that token opens the first
    round."""
    fed, attn, pos, t, tpos = prompt_feed(ids, mask, dense)
    if fed is None:
        return Prefilled(t, tpos, 0.0, 0.0)
    if memo is None:
        return Prefilled(t, tpos, _forward(runner, fed, attn, pos, ids.device), 0.0)
    seconds, saved = memo.run(runner, fed, attn, pos)
    return Prefilled(t, tpos, seconds, saved)
