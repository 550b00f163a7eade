"""Training data for the distill stage: Seq-KD rows, reference completions, collation, the
order of the example stream (on-policy samples are train/onpolicy.py's).

Every source becomes a sequence of `Example` (prompt ids + completion ids, optionally the
target's stored top-k log-probs per completion token); Seq-KD rows are read lazily
(seqkd_rows.py), other sources are lists. Which examples form which micro-batch is a pure
function of (seed, optimizer step, rank, accumulation index), so a resumed run and a run with a
different process count (same global batch) see exactly the same data, and the on-policy coin
for a micro-batch is drawn from the same seed whatever the layout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train.example import Example
from specdistill.distill.train.seqkd_rows import SeqKDRows, lengths
from specdistill.distill.train.seqkd_rows import has_topk as has_topk  # where callers found it


def load_seqkd(path: str | Path, *, limit: int | None = None, use_topk: bool = True):
    """Rows of a generate-stage dataset (`datasets.load_from_disk`) as Examples, read lazily
    (`seqkd_rows.SeqKDRows`: memory-mapped, a row built when a micro-batch asks for it)."""
    return SeqKDRows.open(path, limit=limit, use_topk=use_topk)


def reference_examples(prompts, tokenizer, field: str = "dataset.reference_field") -> list:
    """Prompt + reference completion (the fixed-dataset source), EOS appended like generate."""
    out = []
    for pr in prompts:
        if pr.reference is None:
            raise ConfigError(
                f"{field} is not set or empty for prompt {pr.index}: reference completions are "
                "needed for data.reference=true / eval.source=reference"
            )
        ids = tokenizer(pr.text, add_special_tokens=False)["input_ids"]
        comp = tokenizer(pr.reference, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            comp = [*comp, tokenizer.eos_token_id]
        out.append(Example(prompt_ids=ids, completion_ids=comp))
    return out


def fit_prompt(ids: list[int], room: int, head: int) -> list[int]:
    """The prompt within `room` tokens: its end (nearest the completion), and a chat row's
    `head` (system prompt and template header) kept in front when there is room for more."""
    if len(ids) <= room:
        return list(ids)
    if 0 < head < room:
        return [*ids[:head], *ids[len(ids) - (room - head) :]]
    return list(ids[len(ids) - room :])


def chat_record(path: str | Path | Sequence[str] | None) -> dict[str, Any]:
    """`{"chat": {turns, template_kwargs}}` when the Seq-KD rows at `path` are chat traffic (the
    generate stage's config says so), for the result and the card: a drafter trained on a
    template rendered with arguments (Qwen3's enable_thinking) is served with the same. Several
    folders (one per chat mode, the served one first): the first's arguments, and every
    folder's as `trained_template_kwargs`."""
    paths = [path] if isinstance(path, str | Path) else list(path or ())
    records = []
    for p in paths:
        config = Path(str(p)) / "generation_config.json"
        record = json.loads(config.read_text()) if config.is_file() else {}
        if "chat_turns" in record:
            records.append(record)
    if not records:
        return {}
    chat = {
        "turns": max(r["chat_turns"] for r in records),
        "template_kwargs": records[0]["chat_template_kwargs"],
    }
    if len(records) > 1:
        chat["trained_template_kwargs"] = [r["chat_template_kwargs"] for r in records]
    return {"chat": chat}


def prompts_cut(examples: Sequence[Example], max_seq_len: int) -> int:
    """How many rows `collate` cuts at `max_seq_len` (reported, never silent)."""
    prompt, completion = lengths(examples)
    return int(((prompt + completion) > max_seq_len).sum())


def collated_lengths(examples: Sequence[Example], max_seq_len: int) -> tuple[int, ...]:
    """Each example's length in a collated batch (prompt + completion, cut to max_seq_len)."""
    prompt, completion = lengths(examples)
    return tuple(np.minimum(prompt + completion, max_seq_len).tolist())


def cut_sequence(ex: Example, max_seq_len: int) -> tuple[list[int], int, tuple | None]:
    """(prompt + completion within `max_seq_len`, the prompt's length, the completion's stored
    (top-k ids, log-probs) or None): how every collation cuts a row."""
    comp = list(ex.completion_ids[: max_seq_len - 1])
    prompt = fit_prompt(ex.prompt_ids, max_seq_len - len(comp), ex.prompt_head)
    if not prompt:  # the first completion token needs a context position to predict it
        raise ConfigError("an example has an empty prompt; every row needs prompt_ids")
    top = None
    if ex.topk_ids is not None:
        top = (ex.topk_ids[: len(comp)], ex.topk_logprobs[: len(comp)])
    return [*prompt, *comp], len(prompt), top


def padding_topk(rows: int, width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width, K] top-k ids and log-probs for positions no row fills: a valid (K+1)-way
    distribution (uniform), so masked positions stay finite."""
    ids = torch.arange(k).expand(rows, width, k).clone()
    lp = torch.full((rows, width, k), -torch.log(torch.tensor(k + 1.0)).item())
    return ids, lp


def put_topk(ids: torch.Tensor, lp: torch.Tensor, row: int, at: int, top: tuple) -> None:
    """One sequence's stored top-k written from position `at` of `row`."""
    ti, tl = top
    ids[row, at : at + len(ti)] = torch.tensor(ti, dtype=torch.long)
    lp[row, at : at + len(tl)] = torch.tensor(tl, dtype=torch.float32)


def collate(examples: list[Example], pad_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; `loss_mask[b, t]` marks logits positions whose *next* token is a
    completion token, so logits[:, t] is compared with the target's distribution at t."""
    seqs, starts, tops = zip(*(cut_sequence(ex, max_seq_len) for ex in examples))
    n = max(len(s) for s in seqs)
    b = len(seqs)
    input_ids = torch.full((b, n), pad_id, dtype=torch.long)
    attention = torch.zeros((b, n), dtype=torch.long)
    loss_mask = torch.zeros((b, n), dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        loss_mask[i, st - 1 : len(s) - 1] = True
    batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
    if all(t is not None for t in tops):
        ids, lp = padding_topk(b, n, len(tops[0][0][0]))
        for i, (st, top) in enumerate(zip(starts, tops)):
            put_topk(ids, lp, i, st - 1, top)
        batch["topk_ids"], batch["topk_lp"] = ids, lp
    return batch


@dataclass(frozen=True)
class StreamSpec:
    """The layout of the example stream: what is needed to find any micro-batch's examples.

    `group_by_length` = N > 0 sorts each run of N micro-batches' examples of an epoch's
    permutation by length (`lengths`: each example's collated length), longest first, so a
    micro-batch holds rows of similar length and pads little (`transformers`' group_by_length);
    every example is still read once an epoch, and a micro-batch is still a function of
    (seed, g) alone."""

    num_examples: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    seed: int
    group_by_length: int = 0
    lengths: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def layout(self) -> dict[str, int]:
        """What a checkpoint records and a resumed run must match (lengths follow the data)."""
        keys = ["num_examples", "micro_batch_size", "world_size", "grad_accum", "seed"]
        keys += ["group_by_length"] if self.group_by_length else []  # older checkpoints match
        return {k: getattr(self, k) for k in keys}

    @property
    def micro_per_step(self) -> int:
        return self.world_size * self.grad_accum

    def global_micro_index(self, step: int, accum_index: int, rank: int) -> int:
        """Micro-batch g of the global stream; a step's window is g in [step*W*A, (step+1)*W*A),
        so 1 process x 2 accumulation and 2 processes x 1 see the same window."""
        return step * self.micro_per_step + accum_index * self.world_size + rank

    def examples_seen(self, step: int) -> int:
        """The data position after `step` optimizer steps (examples consumed, all ranks)."""
        return step * self.micro_per_step * self.micro_batch_size

    def indices(self, g: int) -> list[int]:
        """Example indices of micro-batch g: consecutive slots of per-epoch permutations."""
        out = []
        for slot in range(g * self.micro_batch_size, (g + 1) * self.micro_batch_size):
            epoch, pos = divmod(slot, self.num_examples)
            out.append(int(self._order(epoch)[pos]))
        return out

    def _order(self, epoch: int) -> torch.Tensor:
        perm = _epoch_perm(self.seed, epoch, self.num_examples)
        if not self.group_by_length or self.lengths is None:
            return perm
        key = (self.seed, epoch, self.num_examples, self.group_by_length, id(self.lengths))
        if key not in _GROUPED_CACHE:
            if len(_GROUPED_CACHE) > 8:
                _GROUPED_CACHE.clear()
            _GROUPED_CACHE[key] = grouped_by_length(
                perm, self.lengths, self.group_by_length * self.micro_batch_size
            )
        return _GROUPED_CACHE[key]


def grouped_by_length(perm: torch.Tensor, lengths: Sequence[int], size: int) -> torch.Tensor:
    """`perm` with each run of `size` consecutive entries sorted by length, longest first (a
    stable sort: ties keep the permutation's order)."""
    out = perm.clone()
    for start in range(0, len(perm), size):
        run = perm[start : start + size].tolist()
        run.sort(key=lambda i: -lengths[i])
        out[start : start + len(run)] = torch.tensor(run, dtype=perm.dtype)
    return out


_PERM_CACHE: dict[tuple[int, int, int], torch.Tensor] = {}
_GROUPED_CACHE: dict[tuple[int, ...], torch.Tensor] = {}


def _epoch_perm(seed: int, epoch: int, n: int) -> torch.Tensor:
    key = (seed, epoch, n)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 8:
            _PERM_CACHE.clear()
        gen = torch.Generator().manual_seed(seed * 7919 + epoch)
        _PERM_CACHE[key] = torch.randperm(n, generator=gen)
    return _PERM_CACHE[key]


def micro_seed(seed: int, g: int) -> int:
    """A seed for micro-batch g's randomness (on-policy coin and sampling), layout-independent."""
    return (seed * 1_000_003 + g * 7_919 + 17) % (2**63 - 1)


def is_onpolicy(seed: int, g: int, lmbda: float) -> bool:
    """GKD's per-batch coin: with probability lmbda this micro-batch is drafter-generated."""
    if lmbda <= 0.0:
        return False
    if lmbda >= 1.0:
        return True
    gen = torch.Generator().manual_seed(micro_seed(seed, g))
    return bool(torch.rand((), generator=gen).item() < lmbda)
