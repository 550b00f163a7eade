"""The learning-rate schedule of an optim node (`optim.schedule`, `warmup_steps`,
`min_lr_ratio`), as a multiplier per optimizer step: the distill stage's LambdaLR and the online
stage's updates read the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def lr_schedule(optim: Any, max_steps: int) -> Callable[[int], float]:
    """The LR multiplier of `optim` (an optim node: schedule, warmup_steps, min_lr_ratio):
    linear warmup, then cosine/linear decay to min_lr_ratio (or constant). Shared with the
    online stage's updates."""
    warm, total = int(optim.warmup_steps), int(max_steps)
    floor, kind = float(optim.min_lr_ratio), optim.schedule

    def mult(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1 - frac
        return floor + (1 - floor) * shape

    return mult
