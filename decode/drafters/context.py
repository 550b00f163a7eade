"""How much of the prompt the drafter reads (`decoder.drafter_context`).

p = target, q = drafter. The target must read the whole prompt; the drafter need not: its
drafts are only proposals, so reading the last N prompt tokens keeps the decode lossless and
costs N tokens of prefill and cache instead of the whole prompt's. q's slot j holds the target's
slot j + cut, positions shifted alike per row (rotary positions are relative).

`all`: the whole prompt; `auto`: the whole prompt unless the decode would run q past its own
`max_position_embeddings`, then the last tokens that fit (q never reads positions it never
learnt); `N`: at most the last N prompt tokens, within the drafter's positions as `auto`.
"""

from __future__ import annotations

from typing import Any

from specdistill.data.runtime import ConfigError

CONTEXTS = ("auto", "all")


def check_drafter_context(value: Any, field: str = "decoder.drafter_context") -> int | str:
    """`auto`, `all` or an integer >= 1, else a ConfigError naming `field`."""
    if value in CONTEXTS:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{field}={value!r}: use auto (the drafter's own positions), all (the whole prompt) "
            "or N >= 1 (the drafter reads the last N prompt tokens)"
        )
    return value


def drafter_positions(model: Any) -> int | None:
    """The drafter's trained positions (`max_position_embeddings`), None when it has none."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def context_cut(prompt_slots: int, horizon: int, context: int | str, limit: int | None) -> int:
    """Leading prompt slots the drafter skips (pure): `prompt_slots` the prompt's slots (left
    padding included), `horizon` the most positions the decode reaches (prompt + new tokens +
    a round's drafts), `limit` the drafter's trained positions. At least the last prompt token
    (it opens the first round) is always read."""
    if context == "all":
        return 0
    cut = max(0, horizon - limit) if limit else 0
    if isinstance(context, int):
        cut = max(cut, prompt_slots - context)
    return max(0, min(cut, prompt_slots - 1))
