"""`copy:K`: the target layers that let a drafter built from them copy from its context.

Why: most of what a small drafter misses on real text is copying. On SmolLM2-135M's held-out
continuations, 95 of 113 confident misses (target top-1 p > 0.8) by a 4-layer drafter were
tokens already in the context: identifiers and arguments the target repeats. Copying is done by
induction heads (attend to the token after an earlier occurrence of the current one), which sit
deep in the target (SmolLM2: layers 17 and 18) and read a previous-token head below them (layer
16), so `first:K` drafters have none. Distilled on the same budget, keeping that pair beat
`first:4` at the same cost (figures: data/RESULTS.md, "Layer choice after distillation").

The choice is measured, not guessed: a random token run repeated twice is fed to candidate
layer stacks (the target's own weights, untrained); a layer's induction score is its best
head's mean attention from each position of the second copy to the token after its first
occurrence, and a stack's score is the sum over its layers (how much copying the whole stack
does). `copy:K` keeps the first min(2, K-2) layers (they turn embeddings into features every
later layer expects), the (previous-token, induction) pair that scores best on top of them,
then adds layers one at a time, each the one that lifts the score most, up to K. The probe
takes seconds, so it runs once per target and is cached. On SmolLM2 it picks [0, 1, 16, 17] for
K=4 and [0, 1, 16, 17, 18] for K=5, the best of the stacks distilled; the stack's score is a sum
because scoring the last layer alone picked a stack that distilled worse (data/RESULTS.md,
"Layer choice after distillation").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

Score = Callable[[Sequence[int]], float]


def induction_score(attentions: Sequence[torch.Tensor], n: int) -> list[float]:
    """Per layer, the best head's mean attention from position i of the second copy of a
    length-n run to position i - n + 1 (the token after the first occurrence of token i).
    `attentions`: per layer (batch, heads, 2n, 2n)."""
    idx = torch.arange(n, 2 * n)
    return [float(a[:, :, idx, idx - n + 1].float().mean((0, 2)).max()) for a in attentions]


def choose_copy_layers(
    score: Score, num_layers: int, k: int, *, candidates: Sequence[int] | None = None
) -> list[int]:
    """The layer list `copy:k` keeps, given `score(layers)` of a stack (see the module doc).
    `candidates`: induction layers to try (default: all); the previous-token layer ranges over
    every layer between the kept first layers and the induction layer."""
    if not 3 <= k <= num_layers:
        raise ValueError(f"copy:{k} needs 3 <= k <= {num_layers}")
    first = list(range(min(2, k - 2)))
    best: tuple[float, list[int]] | None = None
    for top in candidates if candidates is not None else range(len(first) + 1, num_layers):
        for prev in range(len(first), top):
            layers = [*first, prev, top]
            s = score(layers)
            if best is None or s > best[0]:
                best = (s, layers)
    assert best is not None
    layers = best[1]
    while len(layers) < k:
        rest = [i for i in range(num_layers) if i not in layers]
        layers = max((sorted([*layers, i]) for i in rest), key=score)
    return layers


@contextmanager
def _only_layers(model, layers: Sequence[int]):
    """The model's decoder stack cut to `layers` for the duration (restored after)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = base.config
    saved = (base.layers, config.num_hidden_layers, getattr(config, "layer_types", None))
    try:
        base.layers = torch.nn.ModuleList([saved[0][i] for i in layers])
        config.num_hidden_layers = len(layers)
        if isinstance(saved[2], list | tuple):
            config.layer_types = [saved[2][i] for i in layers]
        yield base
    finally:
        base.layers, config.num_hidden_layers = saved[0], saved[1]
        if isinstance(saved[2], list | tuple):
            config.layer_types = saved[2]


def _stack_scores(model, layers: Sequence[int], ids: torch.Tensor, n: int) -> list[float]:
    with _only_layers(model, layers) as base, torch.no_grad():
        out = base(input_ids=ids, output_attentions=True, use_cache=False)
    if not out.attentions or out.attentions[0] is None:
        raise ValueError("the model returned no attention weights (load it with eager attention)")
    return induction_score(out.attentions, n)


def copy_layers(
    model, k: int, *, n: int = 32, batch: int = 4, seed: int = 0
) -> tuple[list[int], dict]:
    """`copy:k` for a target loaded with attn_implementation="eager" (so attentions come back):
    (layers, how they were found). The induction layers tried are the whole target's 4 best."""
    num = model.config.num_hidden_layers
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    run = torch.randint(min(1000, vocab // 4), vocab, (batch, n), generator=g)  # past specials
    ids = torch.cat([run, run], 1)
    whole = _stack_scores(model, range(num), ids, n)
    first = min(2, k - 2)
    top = [i for i in sorted(range(num), key=lambda i: -whole[i]) if i > first][:4]

    def score(layers: Sequence[int]) -> float:
        return sum(_stack_scores(model, layers, ids, n))

    layers = choose_copy_layers(score, num, k, candidates=top)
    return layers, {
        "induction_by_layer": [round(s, 3) for s in whole],
        "induction_candidates": top,
        "score": round(score(layers), 3),
    }
