"""Batched decoding of the target p: left-padded `generate`, EOS cutting, top-k log-probs.

The pieces of the generate stage that touch the model, kept apart from its bookkeeping
(shards, resume, merge) so the benchmark and tests drive exactly the code the stage runs.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.runtime import eos_ids, pad_rows, padded_positions
from specdistill.data.sampling import Sampling


def sampled_prompt(index: int, share: float) -> bool:
    """Whether prompt `index` of a mixed Seq-KD set is sampled (else greedy): every prefix of
    the prompt indices holds `share` of sampled prompts to within one, spread evenly, so a
    shard, a chunk or a `dataset.limit` of the set keeps the mix."""
    return _sampled_before(index + 1, share) > _sampled_before(index, share)


def _sampled_before(n: int, share: float) -> int:
    """floor(n * share), held against round-off (0.7 * 90 is 62.99999... in floats)."""
    return math.floor(n * share + 1e-9)


@dataclass(frozen=True)
class GenerationSettings:
    """How the target p decodes: greedy (sampling.temperature 0) or sampled with `sampling`,
    `num_samples` completions per prompt, up to `max_new_tokens` each.

    `sampled_share` < 1 (with sampling) makes a mixed set: that share of the prompts sampled, the
    rest greedy (`sampled_prompt`), so one Seq-KD set serves a drafter for both serving modes.
    """

    max_new_tokens: int
    sampling: Sampling
    num_samples: int
    seed: int
    sampled_share: float

    @property
    def do_sample(self) -> bool:
        return not self.sampling.greedy

    @property
    def mixed(self) -> bool:
        return self.do_sample and self.sampled_share < 1.0

    def samples(self, index: int) -> bool:
        """Whether prompt `index` is sampled under these settings."""
        return self.do_sample and (not self.mixed or sampled_prompt(index, self.sampled_share))

    def greedy_part(self) -> GenerationSettings:
        """The settings a mixed set's greedy prompts decode with."""
        return dataclasses.replace(self, sampling=Sampling(), sampled_share=1.0)

    def record(self) -> dict[str, Any]:
        """The settings as generation_config.json's `sampling` (what decides the rows).

        The flat layout the stage has always written, so fingerprints of earlier runs still
        match and they resume: greedy rows do not depend on temperature / top-k / top-p, and
        greedy runs recorded transformers' neutral values (1, 0, 1) for them.
        """
        s = self.sampling if self.do_sample else Sampling(temperature=1.0)
        record = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }
        return record | ({"sampled_share": self.sampled_share} if self.mixed else {})


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt as generated from: row index, text (decoded if truncated), token ids; a chat
    turn's also its conversation, turn (1-based) and the head tokens a cut keeps
    (`data/generate/turns.py`)."""

    index: int
    text: str
    ids: list[int]
    head: int = 0
    conversation: int | None = None
    turn: int = 1


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


LOGITS_BUDGET = 1 << 30  # bytes of fp32 step logits a batch may keep for top-k (else a 2nd pass)

Top = tuple[list[list[int]], list[list[float]]]


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    gen_config: Any,
    eos: Sequence[int],
    topk: int = 0,
) -> tuple[list[tuple[list[int], str]], list[Top] | None]:
    """One left-padded `generate` call: (completions, their top-k or None); rows are
    prompt-major (prompt 0's samples first).

    With `topk`, the top-k of p's temperature-1 log-softmax at each completion position, read
    from generate's own raw step logits when [rows, steps, vocab] fits `LOGITS_BUDGET` (else
    None, and the caller scores with `topk_logprobs`). Keeping them
    saves the second, teacher-forced pass over prompt + completion, about a third of the stage's
    time on SmolLM2 with 1 thread."""
    ids, mask = pad_rows(prompt_ids, gen_config.pad_token_id)
    dev = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    rows_out = len(prompt_ids) * (getattr(gen_config, "num_return_sequences", None) or 1)
    keep = topk and rows_out * gen_config.max_new_tokens * vocab * 4 <= LOGITS_BUDGET
    if keep:  # in the config, not beside it: transformers deprecates passing both
        gen_config = copy.deepcopy(gen_config)
        gen_config.update(output_logits=True, return_dict_in_generate=True)
    out = model.generate(
        input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen_config
    )
    seqs = out.sequences if keep else out
    rows = [split_completion(row, eos) for row in seqs[:, ids.shape[1] :].tolist()]
    if not keep:
        return rows, None
    logits = torch.stack(out.logits, 1)  # (rows, steps, vocab): raw, before any sampling warper
    return rows, [_top(logits[r, : len(c)], topk) for r, (c, _) in enumerate(rows)]


def _top(logits: torch.Tensor, k: int) -> Top:
    """(ids, log-probs) of the k most likely tokens at each row of [positions, vocab] logits."""
    values, indices = logits.float().log_softmax(-1).topk(k, dim=-1)
    return indices.tolist(), values.tolist()


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
    this holds one group of at most `token_budget` tokens, and costs one parallel forward per
    row, small beside token-by-token decoding. Rows are left-padded (explicit positions), so
    every completion ends at the last column and the head runs only over the last
    (longest completion + 1) columns: the prompt positions' logits are never computed (on
    SmolLM2's 49k vocabulary the head and log-softmax over prompt positions had cost as much
    as the rest of the pass).
    """
    results: list[Top] = []
    keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
    start = 0
    while start < len(seqs):
        end, width = start, 0
        while end < len(seqs):
            w = max(width, len(seqs[end][0]) + len(seqs[end][1]))
            if end > start and w * (end - start + 1) > token_budget:
                break
            width, end = w, end + 1
        group = seqs[start:end]
        ids, mask = pad_rows([[*p, *c] for p, c in group], pad_id, side="left")
        keep = max(len(c) for _, c in group) + 1
        dev = model.device
        out = model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=padded_positions(mask).to(dev),
            **({"logits_to_keep": keep} if keep_arg else {}),
        )
        logits = out.logits[:, -keep:]
        results += [
            _top(logits[r, keep - 1 - len(c) : keep - 1], k) for r, (_, c) in enumerate(group)
        ]
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
    if p.conversation is not None:
        row |= {"conversation_index": p.conversation, "turn": p.turn, "prompt_head": p.head}
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
    """The dataset rows for `prompts` (in the given order) and the number of tokens generated.

    A mixed set (`s.mixed`) decodes its greedy and its sampled prompts in separate calls (one
    generation config a call) and returns the rows in the given order."""
    if s.mixed:
        parts = [[p for p in prompts if s.samples(p.index) == sampled] for sampled in (False, True)]
        greedy, g_tokens = generate_rows(
            model, tokenizer, parts[0], s.greedy_part(), batch_size, topk, on_batch
        )
        plain = dataclasses.replace(s, sampled_share=1.0)
        sampled, s_tokens = generate_rows(
            model, tokenizer, parts[1], plain, batch_size, topk, on_batch
        )
        order = {p.index: i for i, p in enumerate(prompts)}
        rows = sorted(greedy + sampled, key=lambda r: (order[r["prompt_index"]], r["sample_index"]))
        return rows, g_tokens + s_tokens
    eos = eos_ids(model.generation_config, tokenizer)
    gen_config = generation_config(s, tokenizer.pad_token_id, eos)
    per_call = max(1, batch_size // s.num_samples)  # batch_size counts sequences
    rows: list[dict[str, Any]] = []
    tokens = 0
    for b in range(0, len(prompts), per_call):
        batch = prompts[b : b + per_call]
        pairs = [(p, j) for p in batch for j in range(s.num_samples)]
        outs, scored = generate_batch(model, [p.ids for p in batch], gen_config, eos, topk)
        if topk and scored is None:  # the step logits would not fit: a teacher-forced pass
            seqs = [(p.ids, c) for (p, _), (c, _) in zip(pairs, outs)]
            scored = topk_logprobs(model, seqs, topk, tokenizer.pad_token_id)
        for (p, j), (completion, reason), top in zip(pairs, outs, scored or [None] * len(outs)):
            rows.append(completion_row(tokenizer, p, j, completion, reason, top))
        new = sum(len(c) for c, _ in outs)
        tokens += new
        on_batch(len(outs), new)
    return rows, tokens
