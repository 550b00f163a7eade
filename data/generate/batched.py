"""Batched decoding of the target p: left-padded `generate`, EOS cutting, top-k log-probs.

The pieces of the generate stage that touch the model, kept apart from its bookkeeping
(shards, resume, merge) so the benchmark and tests drive exactly the code the stage runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.runtime import eos_ids, pad_rows
from specdistill.data.sampling import Sampling


@dataclass(frozen=True)
class GenerationSettings:
    """How the target p decodes: greedy (sampling.temperature 0) or sampled with `sampling`,
    `num_samples` completions per prompt, up to `max_new_tokens` each."""

    max_new_tokens: int
    sampling: Sampling
    num_samples: int
    seed: int

    @property
    def do_sample(self) -> bool:
        return not self.sampling.greedy

    def record(self) -> dict[str, Any]:
        """The settings as generation_config.json's `sampling` (what decides the rows).

        The flat layout the stage has always written, so fingerprints of earlier runs still
        match and they resume: greedy rows do not depend on temperature / top-k / top-p, and
        greedy runs recorded transformers' neutral values (1, 0, 1) for them.
        """
        s = self.sampling if self.do_sample else Sampling(temperature=1.0)
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt as generated from: source index, text (decoded if truncated), token ids."""

    index: int
    text: str
    ids: list[int]


def split_completion(ids: Sequence[int], eos: Sequence[int]) -> tuple[list[int], str]:
    """Cut a generated row after its first EOS (kept); rows without one ran to the length."""
    for pos, t in enumerate(ids):
        if t in eos:
            return list(ids[: pos + 1]), "eos"
    return list(ids), "length"


def generation_config(s: GenerationSettings, pad_id: int, eos: Sequence[int]):
    """Every setting explicit: unset ones would be filled from the checkpoint's defaults."""
    from transformers import GenerationConfig

    kw: dict[str, Any] = {"do_sample": s.do_sample}
    if s.do_sample:
        kw |= s.sampling.as_dict()
    return GenerationConfig(
        max_new_tokens=s.max_new_tokens,
        num_return_sequences=s.num_samples,
        pad_token_id=pad_id,
        eos_token_id=list(eos),
        **kw,
    )


@torch.inference_mode()
def generate_batch(
    model: Any, prompt_ids: Sequence[Sequence[int]], gen_config: Any, eos: Sequence[int]
) -> list[tuple[list[int], str]]:
    """One left-padded `generate` call; rows are prompt-major (prompt 0's samples first)."""
    ids, mask = pad_rows(prompt_ids, gen_config.pad_token_id)
    dev = model.device
    out = model.generate(
        input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen_config
    )
    return [split_completion(row, eos) for row in out[:, ids.shape[1] :].tolist()]


@torch.inference_mode()
def topk_logprobs(
    model: Any,
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    k: int,
    pad_id: int,
    token_budget: int = 8192,
) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Top-k of p's temperature-1 log-softmax at each completion position, per (prompt, completion).

    A second, teacher-forced forward pass rather than `output_logits`: generate would keep
    [steps, rows, vocab] logits alive for the whole batch (GBs for a 128k vocabulary), while
    this holds one right-padded group of at most `token_budget` tokens, and costs one parallel
    forward per row, small beside token-by-token decoding.
    """
    results: list[tuple[list[list[int]], list[list[float]]]] = []
    start = 0
    while start < len(seqs):
        end, width = start, 0
        while end < len(seqs):
            w = max(width, len(seqs[end][0]) + len(seqs[end][1]))
            if end > start and w * (end - start + 1) > token_budget:
                break
            width, end = w, end + 1
        group = seqs[start:end]
        ids, mask = pad_rows([[*p, *c] for p, c in group], pad_id, side="right")
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
        for r, (p, c) in enumerate(group):
            lp = logits[r, len(p) - 1 : len(p) + len(c) - 1].float().log_softmax(-1)
            values, indices = lp.topk(k, dim=-1)
            results.append((indices.tolist(), values.tolist()))
        start = end
    return results


def completion_row(
    tokenizer: Any,
    p: PreparedPrompt,
    sample_index: int,
    completion: list[int],
    reason: str,
    top: tuple[list[list[int]], list[list[float]]] | None,
) -> dict[str, Any]:
    """One dataset row, the same whichever engine generated it (hf here, or vLLM)."""
    row = {
        "prompt_index": p.index,
        "sample_index": sample_index,
        "prompt": p.text,
        "prompt_ids": p.ids,
        "completion": tokenizer.decode(completion, skip_special_tokens=True),
        "completion_ids": completion,
        "finish_reason": reason,
    }
    if top is not None:
        row["topk_ids"], row["topk_logprobs"] = top
    return row


def generate_rows(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[PreparedPrompt],
    s: GenerationSettings,
    batch_size: int,
    topk: int,
    on_batch: Callable[[int, int], None] = lambda rows, tokens: None,
) -> tuple[list[dict[str, Any]], int]:
    """The dataset rows for `prompts` (in the given order) and the number of tokens generated."""
    eos = eos_ids(model.generation_config, tokenizer)
    gen_config = generation_config(s, tokenizer.pad_token_id, eos)
    per_call = max(1, batch_size // s.num_samples)  # batch_size counts sequences
    rows: list[dict[str, Any]] = []
    tokens = 0
    for b in range(0, len(prompts), per_call):
        batch = prompts[b : b + per_call]
        outs = generate_batch(model, [p.ids for p in batch], gen_config, eos)
        pairs = [(p, j) for p in batch for j in range(s.num_samples)]
        scored = (
            topk_logprobs(
                model,
                [(p.ids, c) for (p, _), (c, _) in zip(pairs, outs)],
                topk,
                tokenizer.pad_token_id,
            )
            if topk
            else [None] * len(outs)
        )
        for (p, j), (completion, reason), top in zip(pairs, outs, scored):
            rows.append(completion_row(tokenizer, p, j, completion, reason, top))
        new = sum(len(c) for c, _ in outs)
        tokens += new
        on_batch(len(outs), new)
    return rows, tokens
