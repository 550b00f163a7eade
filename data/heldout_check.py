"""Evaluation prompts checked against the training rows: a figure measured on prompts the
drafter trained on says nothing about serving, so such a set is refused in one line.

Two checks of one rule (evaluation rows are never training rows), with one fix:

- at run time (`check_disjoint`): validate's prompts against a generate-stage dataset (Seq-KD),
  whose `prompt` column holds each row's prompt as the target saw it (a chat row's turn rendered
  with the template), so an evaluation prompt rendered the same way is found by its text;
- from the configs alone (`shared_rows`), before any step runs: two dataset nodes read the same
  rows when a source and its split are the same and no held-out split (`dataset.holdout`, the
  same on both sides) puts them on opposite sides. Which split and side a role reads is
  data/splits.py's rule, the one the readers apply. The pipeline's plan refuses such a run
  (distill/pipeline/heldout_plan.py) instead of letting validate refuse it after generate and
  distill ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.data.prompt_record import Prompt
from specdistill.data.runtime import ConfigError, node_get
from specdistill.data.splits import holdout_side, read_split, source_split, split_path, stage_role

HELDOUT_FIX = (
    "read held-out rows: the set's own test split (dataset.splits: {train: NAME, test: NAME}, "
    "or dataset.path: {train: FILE, test: FILE}) or conversations held out by dataset.holdout "
    "({count: N, seed: 0, from_split: NAME})"
)


def training_prompts(path: str | Path) -> set[str]:
    """The prompt texts of a generate-stage dataset (every turn's)."""
    import datasets

    p = Path(str(path)).expanduser()
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # not a saved dataset: say which path
        raise ConfigError(
            f"training_data={str(path)!r} is not a generate-stage dataset ({e!r}); point it at "
            "the Seq-KD run the drafter trained on, or null"
        ) from e
    return {t.strip() for t in ds["prompt"]}


def check_disjoint(prompts: Sequence[Prompt], path: str | Path | None) -> int:
    """How many training prompts `path` holds (0 when null), after refusing, in one line, an
    evaluation set with any prompt among them."""
    if path is None:
        return 0
    seen = training_prompts(path)
    hits = [p for p in prompts if p.text.strip() in seen]
    if hits:
        raise ConfigError(
            f"{len(hits)} of {len(prompts)} evaluation prompts (e.g. prompt {hits[0].index}"
            f"{f' of {hits[0].source}' if hits[0].source else ''}) are training rows of "
            f"training_data={str(path)!r}: {HELDOUT_FIX}"
        )
    return len(seen)


@dataclass(frozen=True)
class RowSide:
    """The rows a dataset node reads for a role, as its config says (nothing is read)."""

    source: str  # what holds the rows: `hub NAME`, `file PATH`, `toy stdlib`, `self queries`, ...
    split: str  # the source's split; "" where every split reads the same rows (a file)
    holdout: str  # the held-out split's settings; "" when none cuts the rows
    side: str  # all (no holdout) | train (the rest) | held (the held-out conversations)
    named: str = field(default="", compare=False)  # the split as the config names it

    def where(self) -> str:
        """The rows' place for an error line: `split 'train_sft' of hub NAME`."""
        return f"split {self.split or self.named!r} of {self.source}"


def why_shared(train: RowSide, evaluation: RowSide) -> str:
    """Why two sides of one source and split may hold the same rows, for an error line."""
    if not train.holdout and not evaluation.holdout:
        return "no dataset.holdout between them"
    if train.holdout == evaluation.holdout:
        return f"both read the {train.side} side of dataset.holdout {train.holdout}"
    return (
        f"dataset.holdout {train.holdout or 'none'} for training but "
        f"{evaluation.holdout or 'none'} for evaluation"
    )


def shares_rows(train: RowSide, evaluation: RowSide) -> bool:
    """Whether `evaluation` may read rows `train` reads: the same source and split, unless one
    held-out split puts them on opposite sides."""
    if (train.source, train.split) != (evaluation.source, evaluation.split):
        return False
    opposite = {train.side, evaluation.side} == {"train", "held"}
    return not (train.holdout and train.holdout == evaluation.holdout and opposite)


def row_sides(dataset: Any, role: str) -> list[RowSide]:
    """What a stage reading `dataset` for `role` (train, test) reads: one side per source (a
    mixture's members each)."""
    from specdistill.data.chat_prompts import is_conversation_set, member_nodes

    role = stage_role(dataset, role)
    if node_get(dataset, "source") == "mixture":  # a member reads its own split, else the role
        return [
            _side(node, str(node.get("split") or role), chat=True) for node in member_nodes(dataset)
        ]
    return [_side(dataset, role, chat=is_conversation_set(dataset))]


def shared_rows(
    train: Any, train_role: str, evaluation: Any, eval_role: str
) -> list[tuple[RowSide, RowSide]]:
    """(training side, evaluation side) pairs that may hold the same rows (none: disjoint)."""
    return [
        (t, e)
        for t in row_sides(train, train_role)
        for e in row_sides(evaluation, eval_role)
        if shares_rows(t, e)
    ]


def _side(node: Any, role: str, *, chat: bool) -> RowSide:
    """One source's side: only conversation sets are cut by `holdout` (data/chat_prompts.py)."""
    holdout = node_get(node, "holdout") if chat else None
    read = read_split(node, role) if chat else role
    source, split = _source(node, read)
    cut = ""
    if holdout:
        keys = ("share", "count", "seed")
        cut = "{" + ", ".join(f"{k}: {node_get(holdout, k)}" for k in keys) + "}"
    side = holdout_side(role) if holdout else "all"
    return RowSide(source, split, cut, side, named=source_split(node, read))


def _source(node: Any, split: str) -> tuple[str, str]:
    """(what holds the rows, its split) of one source for `split` (a role or a split name)."""
    kind = node_get(node, "source", "toy")
    if kind == "hub":
        name = f"hub {node_get(node, 'name')}"
        for key in ("config", "revision"):
            if node_get(node, key):
                name += f" {key}={node_get(node, key)}"
        return name, source_split(node, split)
    if kind in ("jsonl", "json", "parquet", "csv"):  # a file holds one split
        return f"file {split_path(node, split)}", ""
    if kind == "toy":  # every toy world cuts the stdlib by the same module rule
        return "toy stdlib", split
    if kind == "toy_stream":  # every split reads the same prompts
        return f"stream {node_get(node, 'group')} stride {node_get(node, 'stride')}", ""
    if kind == "long":
        docs = node_get(node, "documents", "stdlib")
        where = node_get(node, "path") or node_get(node, "name") or ""
        return f"long {docs} {where}".strip(), split
    if kind == "self":  # the same queries for every split (holdout splits them)
        return f"self queries of {node_get(node, 'model') or 'the target'}", ""
    return f"{kind} {node_get(node, 'path') or node_get(node, 'name') or ''}".strip(), split
