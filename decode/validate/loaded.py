"""`Setup`: validate's pair loaded and its prompts batched, as the stage and every engine read them.

Pure data, built once by `decode/validate/setup.py` after every check has passed; the engines
(decode/validate/engines/) and the decoder benchmark (decode/bench/) read it, so it lives apart
from the code that loads it. p = target, q = drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec
from specdistill.decode.drafters.mapped import MappedVocab
from specdistill.decode.validate.target_only import TargetOnlyCache

Batch = tuple[torch.Tensor, torch.Tensor]  # left-padded (ids, attention mask)


@dataclass
class Setup:
    """A loaded pair and its prompts as left-padded batches (shared with decode.bench)."""

    spec: PairSpec
    target: Any  # the target p, a transformers causal LM
    drafter: Any  # the drafter q, a transformers causal LM
    tok: Any  # the target's tokenizer
    device: torch.device
    dtype: torch.dtype
    eos: tuple[int, ...]
    texts: list[str]
    batches: list[Batch]
    warm: list[Batch]
    engines: tuple[str, ...] = ("ours",)
    # what each engine's preflight handed on to its run (decode/validate/engines/), by name
    ready: dict[str, Any] = field(default_factory=dict)
    # How prompts were fitted to the context: policy, budget, how many were long / truncated /
    # skipped (`fit_prompt_set`); and each kept prompt's context-length bucket (long sets, else None).
    prompt_fit: dict[str, Any] = field(default_factory=dict)
    buckets: list[str | None] = field(default_factory=list)
    mapped: MappedVocab | None = (
        None  # the drafter has its own tokenizer (decode/validate/mapped.py)
    )
    # chat benchmarks: each prompt's (set, category) (decode/validate/categories.py), else None
    categories: list[tuple[str, str]] | None = None
    # the run's shared target-only side (decode/validate/target_only.py), else None
    target_only: TargetOnlyCache | None = None
