"""On-policy batches (GKD, `lmbda > 0`): the drafter's own completions of a micro-batch's
prompts, sampled with `onpolicy.sampling` through `transformers.generate` (vLLM rollouts are
train/rollouts.py's), under an RNG forked per micro-batch so that a resumed run and any process
layout draw the same samples.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.data.sampling import Sampling
from specdistill.distill.train.example import Example


def _generate_sampling(sampling: Sampling) -> dict[str, Any]:
    """`generate` keywords for a sampling spec (top_k 0 and top_p 1 are off there too)."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, **sampling.as_dict()}


@torch.no_grad()
def sample_onpolicy(
    model,
    examples: list[Example],
    *,
    pad_id: int,
    eos_id: int | None,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    synced_gpus: bool = False,
) -> list[Example]:
    """The drafter's own completions for the examples' prompts (GKD on-policy data), sampled
    with `sampling` (`onpolicy.sampling`; temperature 0: the drafter's greedy output).

    Sampling runs under a forked RNG seeded per micro-batch, so it neither depends on nor
    disturbs the global RNG stream (resume and process layout stay exact).
    """
    device = next(model.parameters()).device
    n = max(len(e.prompt_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, e in enumerate(examples):  # left-pad for decoder-only generation
        ids[i, n - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
        att[i, n - len(e.prompt_ids) :] = 1
    was_training = model.training
    model.eval()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=att.to(device),
            **_generate_sampling(sampling),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            synced_gpus=synced_gpus,
        )
    model.train(was_training)
    return [
        Example(e.prompt_ids, end_completion(out[i, n:].tolist(), pad_id, eos_id))
        for i, e in enumerate(examples)
    ]


def end_completion(comp: list[int], pad_id: int, eos_id: int | None) -> list[int]:
    """A sampled completion cut where it ended: after its first EOS (kept), else before the
    first pad token (generate pads finished rows with it); never empty (one pad then)."""
    if eos_id is not None and eos_id in comp:
        comp = comp[: comp.index(eos_id) + 1]
    elif pad_id in comp and pad_id != eos_id:
        comp = comp[: comp.index(pad_id)]
    return comp or [pad_id]
