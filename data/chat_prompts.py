"""Chat prompt sets: conversations from one source or a weighted mixture of several, split into
training and held-out conversations, rendered with the target's chat template.

    dataset.format: messages | sharegpt | turns | plain   (data/conversations.py)
    dataset.holdout: {share: 0.05} or {count: 64}, seed   (by conversation; train: the rest,
                     from_split                           any other split: the held-out ones)
    dataset.splits: {train: train_sft, test: test_sft}   (the source's names for the roles;
                                                          data/splits.py)
    dataset.chat_template_kwargs: {enable_thinking: false} (every place a template is applied)
    dataset.source: mixture, dataset.mixture: [{label, weight, <a dataset node>}, ...]
    dataset.per_category: N                              (N conversations of each category)
    dataset.source: self, count: N                       (queries sampled from the target,
                                                          data/self_queries.py)

Each prompt opens a conversation (turn 1); generate and validate render its later turns after
the target's own answers (`later_turn`). `limit` draws conversations in a seeded hash order (a
source sorted by task, like the T0 sample, is not cut to its first tasks) and keeps source order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from specdistill.data.conversations import (
    Conversation,
    interleave,
    messages_for,
    mixture_counts,
    read_conversations,
    render,
    split_holdout,
    template_kwargs,
)
from specdistill.data.dataset_rows import file_rows, hub_rows
from specdistill.data.prompt_record import Prompt
from specdistill.data.runtime import ConfigError, node_get
from specdistill.data.splits import read_split

_get = node_get
# Keys a mixture member inherits from the mixture's node when it does not set them.
_INHERITED = ("chat_template_kwargs", "holdout", "format", "malformed", "chat")


def is_conversation_set(cfg: Any) -> bool:
    """Whether `load_prompts` reads the set as conversations (a chat template applies)."""
    return (
        bool(_get(cfg, "format"))
        or bool(_get(cfg, "chat", False))
        or (_get(cfg, "field") == "messages")
        or _get(cfg, "source") == "self"
    )


def chat_prompts(
    cfg: Any, tokenizer: Any, split: str, *, target: str | None = None
) -> list[Prompt]:
    """The set's turn-1 prompts, rendered; each carries its conversation for later turns.
    `target`: the stage's resolved target path (`source: self` samples its queries from it)."""
    if _get(cfg, "source") == "mixture":
        convs = mixture_conversations(cfg, split, target=target, tokenizer=tokenizer)
    else:
        convs = source_conversations(
            cfg, split, label=_get(cfg, "label"), target=target, tokenizer=tokenizer
        )
        convs = _limited(convs, _get(cfg, "limit"), int(_get(cfg, "seed") or 0), "dataset.limit")
        convs = [replace(c, index=i) for i, c in enumerate(convs)]
    if not convs:
        raise ConfigError(
            f"dataset (split={split!r}) has no conversations left: check dataset.path/name/split "
            "and dataset.holdout"
        )
    kwargs = template_kwargs(cfg)
    chat = _get(cfg, "format") != "plain" or bool(_get(cfg, "chat", False))
    if chat:
        check_template(tokenizer)
    frozen = tuple(sorted(kwargs.items()))
    return [
        Prompt(
            index=c.index,
            text=render(tokenizer, messages_for(c, 1, []), kwargs) if chat else c.turns[0].user,
            reference=c.turns[0].reference,
            category=c.category,
            source=c.source,
            conversation=c if chat else None,  # later turns and cuts re-render the template
            turn=1,
            template_kwargs=frozen if chat else (),
        )
        for c in convs
    ]


def check_template(tokenizer: Any) -> None:
    """Chat sets need the target's chat template; one line saying so before any weights load."""
    if tokenizer is None:
        raise ConfigError("chat prompts need the target's tokenizer to apply its chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "dataset.format is a chat format but the target's tokenizer has no chat_template: "
            "use a chat model's tokenizer (pair.tokenizer) or dataset.format=plain with "
            "dataset.chat=false"
        )


def later_turn(tokenizer: Any, prompt: Prompt, turn: int, answers: Sequence[str]) -> Prompt:
    """Turn `turn` of the prompt's conversation, rendered after `answers` (the target's own
    replies to the earlier turns), with the same template arguments."""
    conv = prompt.conversation
    if conv is None:
        raise ValueError("later_turn needs a chat prompt (one that carries its conversation)")
    kwargs = dict(prompt.template_kwargs)
    return Prompt(
        index=prompt.index,
        text=render(tokenizer, messages_for(conv, turn, answers), kwargs),
        reference=conv.turns[turn - 1].reference,
        category=prompt.category,
        source=prompt.source,
        conversation=conv,
        turn=turn,
        answers=tuple(answers[: turn - 1]),
        template_kwargs=prompt.template_kwargs,
    )


def source_conversations(
    cfg: Any,
    split: str,
    *,
    label: str | None,
    target: str | None = None,
    tokenizer: Any = None,
    field: str = "dataset",
) -> list[Conversation]:
    """One source's conversations of `split`, its held-out split applied. `target` and
    `tokenizer` (the stage's) are what `source: self` samples with; `field` names the node."""
    read = read_split(cfg, split)  # data/splits.py: the one rule the plan checks too
    if _get(cfg, "source") == "self":  # the same queries for every split: `holdout` splits them
        from specdistill.data.self_queries import self_query_rows

        rows = self_query_rows(cfg, target, tokenizer, field=field)
        reader: Any = {"format": "messages", "field": "messages"}  # the rows' own form
    else:
        rows, reader = _rows(cfg, read), cfg
    convs, _skipped = read_conversations(rows, reader, source=label)
    if label and not _get(cfg, "category_field"):
        convs = [replace(c, category=label, source=label) for c in convs]
    convs = split_holdout(convs, cfg, split)
    per = _get(cfg, "per_category")
    if per is not None:  # a benchmark sorted by category: the same few from each
        seed = int(_get(cfg, "seed") or 0)
        groups: dict[str | None, list[Conversation]] = {}
        for c in convs:
            groups.setdefault(c.category, []).append(c)
        keep = {id(c) for g in groups.values() for c in _limited(g, per, seed, "per_category")}
        convs = [c for c in convs if id(c) in keep]
    return convs


def _rows(cfg: Any, split: str) -> list[dict]:
    source = _get(cfg, "source")
    if source == "hub":
        return hub_rows(cfg, split)
    if source in ("jsonl", "json", "parquet", "csv"):
        return file_rows(cfg, source, split)
    if source == "toy":
        from specdistill.data.toy.world import toy_prompts

        if split not in ("train", "test"):
            raise ConfigError(f"dataset.split={split!r}: the toy prompt set has train and test")
        return toy_prompts(_get(cfg, "toy") or "toy-tiny", split)
    raise ConfigError(
        f"dataset.source={source!r} cannot hold conversations; use hub, jsonl, json, parquet, "
        "csv, toy, self or mixture"
    )


def member_nodes(cfg: Any) -> list[dict[str, Any]]:
    """A mixture's members as dataset nodes: each member's keys over those it inherits."""
    members = _get(cfg, "mixture")
    if not members:
        raise ConfigError("dataset.source=mixture needs dataset.mixture: a list of sources")
    nodes = []
    for member in members:
        node = {**{key: _get(cfg, key) for key in _INHERITED if _get(cfg, key) is not None}}
        node.update({key: member[key] for key in member})
        if node.get("source") == "self" and node.get("seed") is None:  # the mixture's seed
            node["seed"] = _get(cfg, "seed")
        nodes.append(node)
    return nodes


def self_sources(cfg: Any) -> list[tuple[str, Any]]:
    """(field, node) of each `source: self` node of a dataset: itself or its mixture members."""
    if _get(cfg, "source") == "self":
        return [("dataset", cfg)]
    if _get(cfg, "source") != "mixture":
        return []
    nodes = enumerate(member_nodes(cfg))
    return [(f"dataset.mixture[{k}]", n) for k, n in nodes if n.get("source") == "self"]


def prefetch_self_queries(cfg: Any, target: str | None, tokenizer: Any) -> int:
    """Sample (or find cached) every `source: self` node's queries now, in this process: the
    generate stage does it once with every core before its one-thread shard processes start,
    so they only read the cached file. How many nodes there were."""
    from specdistill.data.self_queries import self_query_rows

    found = self_sources(cfg)
    for field, node in found:
        self_query_rows(node, target, tokenizer, field=field)
    return len(found)


def mixture_conversations(
    cfg: Any, split: str, *, target: str | None = None, tokenizer: Any = None
) -> list[Conversation]:
    """A weighted mixture of sources, interleaved evenly: `limit` conversations in all (null:
    as many as the scarcest source allows at its weight), shared by `weight`."""
    seed = int(_get(cfg, "seed") or 0)
    parts, weights, labels = [], [], []
    for k, node in enumerate(member_nodes(cfg)):
        label = node.get("label") or f"source{k}"
        if label in labels:
            raise ConfigError(f"dataset.mixture[{k}].label={label!r} is used twice")
        weight = node.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight < 0:
            raise ConfigError(f"dataset.mixture[{k}].weight={weight!r} must be a number >= 0")
        member_split = node.get("split") or split
        convs = source_conversations(
            node,
            member_split,
            label=label,
            target=target,
            tokenizer=tokenizer,
            field=f"dataset.mixture[{k}]",
        )
        parts.append(_limited(convs, node.get("limit"), seed, f"dataset.mixture[{k}].limit"))
        weights.append(float(weight))
        labels.append(label)
    available = [len(p) for p in parts]
    limit = _get(cfg, "limit")
    if limit is None:
        active = [(a, w) for a, w in zip(available, weights) if w > 0]
        total = int(min(a * sum(weights) / w for a, w in active))
    else:
        total = int(limit)
        if total <= 0:
            raise ConfigError(f"dataset.limit={limit} must be positive (or null)")
    counts = mixture_counts(weights, available, total)
    drawn = [_limited(p, n, seed, "mixture") for p, n in zip(parts, counts)]
    return interleave(drawn)


def _limited(convs: list[Conversation], limit: Any, seed: int, name: str) -> list[Conversation]:
    """`limit` conversations drawn in a seeded hash order of their keys, in source order."""
    if limit is None:
        return convs
    if int(limit) < 0:
        raise ConfigError(f"{name}={limit} must be >= 0 (or null for all)")
    if int(limit) >= len(convs):
        return convs
    rank = sorted(
        range(len(convs)),
        key=lambda i: hashlib.sha256(f"{seed}/{convs[i].key}/{i}".encode()).digest(),
    )
    keep = sorted(rank[: int(limit)])
    return [convs[i] for i in keep]
