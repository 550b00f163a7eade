"""A drafter's draft vocabulary: its LM head over the tokens the target actually emits.

A small drafter of a large-vocabulary target pays much of its step for the head, while the
target's continuations use a small part of the vocabulary. So the decoder can score only a
frequency-ranked subset (FR-Spec; EAGLE-3's reduced draft vocabulary): q is the drafter's
softmax over the subset and 0 elsewhere, still a distribution the acceptance rule takes as is,
so decoding stays lossless (the residual max(p - q, 0) covers every token outside it). Only
acceptance can fall, where the target emits a token a small drafter rarely predicts anyway.

The subset is stored in the drafter's `config.json` as `draft_vocab_ids`, so every
`save_pretrained` carries it and engines that do not know the key ignore it. The decoder applies
it only inside its own decode steps (`ModelRunner`), never to a training forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from specdistill.data.runtime import ConfigError

CONFIG_KEY = "draft_vocab_ids"
AUTO_MIN_VOCAB = 16384  # auto: heads this large; smaller ones by choice
AUTO_SIZE = 4096  # most of the head's cost gone, acceptance kept


def draft_vocab_size(setting: object, vocab: int) -> int:
    """Tokens to keep for `distill.draft_vocab` (0: the full head): auto, 0/none or a size."""
    if setting in (None, "none", 0):
        return 0
    if setting == "auto":
        return AUTO_SIZE if vocab >= AUTO_MIN_VOCAB else 0
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError(
            f"draft_vocab={setting!r} must be auto, none/0 or a token count >= 1 "
            "(the drafter's head at decode time keeps that many of the most frequent tokens)"
        )
    return min(setting, vocab)


def choose_draft_vocab(
    sequences: Iterable[Sequence[int]], vocab: int, size: int, always: Sequence[int] = ()
) -> list[int]:
    """The `size` most frequent ids in `sequences` (ties: lower id first), then `always` (EOS and
    the like), then the lowest unused ids: BPE assigns low ids to early, frequent merges."""
    if size >= vocab:
        return list(range(vocab))
    counts = np.zeros(vocab, dtype=np.int64)
    for seq in sequences:  # lists or flat numpy arrays (lazy Seq-KD rows): counted with bincount
        ids = np.asarray(seq, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts += np.bincount(ids, minlength=vocab)
    keep = [int(t) for t in always if 0 <= t < vocab]
    chosen = dict.fromkeys(keep)
    seen = np.flatnonzero(counts)
    for t in seen[np.lexsort((seen, -counts[seen]))]:  # most frequent first, ties: lower id
        if len(chosen) >= size:
            break
        chosen.setdefault(int(t))
    t = 0
    while len(chosen) < size:
        chosen.setdefault(t)
        t += 1
    return list(chosen)


def drafter_vocab_ids(
    sequences: Iterable[Sequence[int]],
    vocab: int,
    size: int,
    eos: Sequence[int],
    mask_id: int | None,
) -> list[int]:
    """What a drafter stores as its draft vocabulary: `choose_draft_vocab` with the EOS ids
    always in, and a parallel drafter's mask id never (it is not a token to draft)."""
    ids = choose_draft_vocab(sequences, vocab, size, eos)
    return ids if mask_id is None else [t for t in ids if t != mask_id]


def draft_vocab_of(model) -> list[int] | None:
    """The ids stored in a drafter's config, checked (one clear line on a broken list)."""
    ids = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if ids is None:
        return None
    vocab = model.get_output_embeddings().weight.shape[0]
    name = getattr(model.config, "_name_or_path", "") or "the drafter"
    ok = isinstance(ids, (list, tuple)) and ids and all(isinstance(t, int) for t in ids)
    if not ok or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab:
        raise ConfigError(
            f"pair.drafter={name}: config.json {CONFIG_KEY} must be distinct token ids in "
            f"[0, {vocab}); remove the key to decode with the full head"
        )
    return list(ids)


class SubsetHead(torch.nn.Module):
    """The output layer over `ids` only; every other logit is the dtype's minimum (q = 0 there,
    and 0 * log q stays 0). Its weight is a copy, refreshed when the full head changes in place
    (an optimizer step between online decodes; inference-mode weights cannot change that way)."""

    def __init__(self, head: torch.nn.Linear, ids: Sequence[int]) -> None:
        super().__init__()
        self.full = [head]  # a list: not a submodule, so the copy is the only parameter-like state
        self.vocab = head.weight.shape[0]
        self.register_buffer("ids", torch.tensor(list(ids), device=head.weight.device))
        self.proj = torch.nn.Linear(head.weight.shape[1], len(ids), bias=head.bias is not None)
        self.proj.requires_grad_(False)
        self._version: int | None = None
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        head = self.full[0]
        try:
            version = head.weight._version
        except RuntimeError:  # created under inference_mode: never trained, copied once
            version = -1
        if version == self._version:
            return
        self.proj.to(device=head.weight.device, dtype=head.weight.dtype)
        self.proj.weight.copy_(head.weight.index_select(0, self.ids))
        if head.bias is not None:
            self.proj.bias.copy_(head.bias.index_select(0, self.ids))
        self._version = version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        out = y.new_full((*y.shape[:-1], self.vocab), torch.finfo(y.dtype).min)
        return out.index_copy_(-1, self.ids, y)


def _head_name(model) -> str:
    head = model.get_output_embeddings()
    for name, child in model.named_children():
        if child is head:
            return name
    raise ConfigError(
        f"{type(model).__name__}: its output embeddings are not a direct submodule, so a draft "
        f"vocabulary cannot be applied; set decoder.draft_vocab=full"
    )


def subset_head(model, ids: Sequence[int]) -> tuple[str, SubsetHead]:
    """(attribute name, head) for `swapped_head`; checked when the decoder is built."""
    name = _head_name(model)
    head = getattr(model, name)
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(
            f"{type(model).__name__}.{name} is a {type(head).__name__}, not a linear layer: "
            "set decoder.draft_vocab=full"
        )
    return name, SubsetHead(head, ids)


@contextmanager
def swapped_head(model, head: tuple[str, SubsetHead] | None) -> Iterator[None]:
    """Within the block `model`'s output layer is the subset head (the decoder's steps only)."""
    if head is None:
        yield
        return
    name, sub = head
    previous = getattr(model, name)
    if previous is sub:  # nested
        yield
        return
    sub.refresh()
    setattr(model, name, sub)
    try:
        yield
    finally:
        setattr(model, name, previous)


def attach_draft_vocab(drafter: str, data: str, size: int, out: str | None = None) -> dict:
    """Store a draft vocabulary in an already trained drafter checkpoint: the `size` most
    frequent ids of a Seq-KD dataset, EOS always in, a parallel drafter's mask id never. Written
    into a copy at `out` (or in place), so it stays one `from_pretrained` folder."""
    import shutil
    from pathlib import Path

    from specdistill.data.io import atomic_write_json, read_json

    src = Path(drafter).expanduser()
    if not (src / "config.json").is_file():
        raise ConfigError(f"--drafter {drafter}: no config.json there; point it at a checkpoint")
    rows = _dataset_rows(data)
    cfg = read_json(src / "config.json")
    vocab = int(cfg.get("vocab_size") or 0)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < vocab:
        raise ConfigError(f"--size {size}: name a token count in 1..{vocab - 1} (vocab {vocab})")
    eos = cfg.get("eos_token_id")
    always = [t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int)]
    import pyarrow.compute as pc

    table = rows.flatten_indices().data.table if rows._indices is not None else rows.data.table
    seqs = (pc.list_flatten(table.column(c)).to_numpy() for c in ("prompt_ids", "completion_ids"))
    ids = drafter_vocab_ids(seqs, vocab, size, always, cfg.get("mask_token_id"))
    dst = Path(out).expanduser() if out else src
    if dst.resolve() != src.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg[CONFIG_KEY] = ids
    atomic_write_json(dst / "config.json", cfg)
    return {"drafter": str(dst), "draft_vocab": len(ids), "vocab_size": vocab}


def _dataset_rows(data: str):
    from datasets import load_from_disk

    try:
        rows = load_from_disk(str(data))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"--data {data}: not a dataset folder ({e}); point it at a generate stage's output"
        ) from None
    missing = {"prompt_ids", "completion_ids"} - set(rows.column_names)
    if missing:
        raise ConfigError(f"--data {data}: no {sorted(missing)} columns; use a Seq-KD dataset")
    return rows


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m specdistill.decode.draft_vocab --drafter DIR --data SEQKD --size N
    [--out DIR]`; prints the checkpoint written."""
    import argparse
    import json

    from specdistill.data.runtime import run_or_exit

    parser = argparse.ArgumentParser(
        prog="python -m specdistill.decode.draft_vocab",
        description="store a draft vocabulary in a trained drafter checkpoint",
    )
    parser.add_argument("--drafter", required=True, help="the drafter checkpoint folder")
    parser.add_argument("--data", required=True, help="a Seq-KD dataset (generate's output)")
    parser.add_argument("--size", required=True, type=int, help="tokens to keep, e.g. 1024")
    parser.add_argument("--out", default=None, help="write a copy here (default: in place)")
    args = parser.parse_args(argv)
    done = run_or_exit(lambda a: attach_draft_vocab(a.drafter, a.data, a.size, a.out), args)
    print(json.dumps(done))


if __name__ == "__main__":
    main()
