"""Conversations: the unit of chat data, read from OpenAI messages, ShareGPT, MT-Bench-style turn
lists or plain prompt/completion rows.

A conversation is an optional system prompt and its user turns, each with the source's own
answer (a reference, kept for reports: the target regenerates every answer). Generate answers
turn 1, then renders turn 2 with the target's own turn-1 reply, and so on, so every training
context is one the target produces (SpecForge and speculators regenerate likewise); validate
decodes a benchmark's later turns after the target's own earlier answers.

A malformed conversation (an unknown role, an empty turn, two user turns with no answer between
them, a multi-turn conversation ending in an unanswered user turn, a system prompt after the
first message) is one error line naming the row and the fix, or skipped and counted with
`dataset.malformed=skip`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdistill.data.runtime import ConfigError, node_get
from specdistill.data.splits import holdout_side

FORMATS = ("messages", "sharegpt", "turns", "plain")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Turn:
    """One user turn and the source's own answer to it (None where the source has none)."""

    user: str
    reference: str | None = None


@dataclass(frozen=True)
class Conversation:
    """A system prompt (or None) and its user turns, in order.

    `key` identifies the conversation for the held-out split (the source's id field, else a
    hash of its content), so the split does not move when rows are reordered or added.
    """

    index: int
    key: str
    turns: tuple[Turn, ...]
    system: str | None = None
    category: str | None = None
    source: str | None = None


class Malformed(ValueError):
    """A row that is not a conversation; the reader turns it into an error line or a skip."""


def read_conversations(
    rows: Sequence[dict[str, Any]], cfg: Any, *, source: str | None = None
) -> tuple[list[Conversation], int]:
    """(conversations, rows skipped as malformed) from a set's rows per `dataset.format`."""
    fmt = _get(cfg, "format") or "messages"
    if fmt not in FORMATS:
        raise ConfigError(f"dataset.format={fmt!r} is not known; use one of {', '.join(FORMATS)}")
    field = _get(cfg, "field") or _DEFAULT_FIELD[fmt]
    ref_field = _get(cfg, "reference_field") if fmt == "plain" else None  # others hold answers
    system_field = _get(cfg, "system_field")
    category_field = _get(cfg, "category_field")
    id_field = _get(cfg, "id_field")
    malformed = _get(cfg, "malformed") or "error"
    if malformed not in ("error", "skip"):
        raise ConfigError(f"dataset.malformed={malformed!r} must be error or skip")
    if rows:
        for name, key in (
            ("field", field),
            ("reference_field", ref_field),
            ("system_field", system_field),
            ("category_field", category_field),
            ("id_field", id_field),
        ):
            if key and key not in rows[0]:
                raise ConfigError(
                    f"dataset.{name}={key!r} is not a column of the set (format={fmt}); columns "
                    f"are {sorted(rows[0])}"
                )
    out: list[Conversation] = []
    skipped = 0
    for n, row in enumerate(rows):
        try:
            system, turns = _PARSERS[fmt](row[field], row.get(ref_field) if ref_field else None)
        except Malformed as e:
            if malformed == "skip":
                skipped += 1
                continue
            raise ConfigError(
                f"dataset row {n} (format={fmt}, field {field!r}): {e}; fix the row or set "
                "dataset.malformed=skip"
            ) from None
        if system_field and row.get(system_field):
            system = str(row[system_field])
        key = str(row[id_field]) if id_field else _content_key(system, turns)
        category = str(row[category_field]) if category_field else None
        out.append(Conversation(len(out), key, turns, system, category, source))
    return out, skipped


_DEFAULT_FIELD = {
    "messages": "messages",
    "sharegpt": "conversations",
    "turns": "turns",
    "plain": "prompt",
}


_get = node_get


def _content_key(system: str | None, turns: Sequence[Turn]) -> str:
    blob = repr((system, [t.user for t in turns])).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _from_roles(messages: Sequence[tuple[str, Any]]) -> tuple[str | None, tuple[Turn, ...]]:
    """(system, turns) from (role, content) pairs, checked: roles known, contents non-empty
    text, a system prompt first only, user and assistant alternating from a user turn."""
    if not messages:
        raise Malformed("the conversation has no messages")
    system = None
    turns: list[Turn] = []
    pending: str | None = None  # a user turn waiting for its answer
    for k, (role, content) in enumerate(messages):
        if role not in ("system", "user", "assistant"):
            raise Malformed(f"message {k} has role {role!r}; use system, user or assistant")
        if not isinstance(content, str) or not content.strip():
            raise Malformed(f"message {k} ({role}) is empty")
        if role == "system":
            if k != 0:
                raise Malformed(f"message {k} is a system prompt after the first message")
            system = content
        elif role == "user":
            if pending is not None:
                raise Malformed(
                    f"message {k} is a user turn after an unanswered user turn: an assistant "
                    "answer is expected between them"
                )
            pending = content
        else:
            if pending is None:
                raise Malformed(f"message {k} is an assistant turn with no user turn before it")
            turns.append(Turn(pending, content))
            pending = None
    if pending is not None:
        if turns:
            raise Malformed(
                f"the conversation ends in a user turn after {len(turns)} answered turns: an "
                "answer is expected there (drop the trailing user message)"
            )
        turns.append(Turn(pending, None))  # a one-turn prompt: the target answers it
    if not turns:
        raise Malformed("the conversation has no user turn")
    return system, tuple(turns)


def _parse_messages(value: Any, _ref: Any) -> tuple[str | None, tuple[Turn, ...]]:
    if isinstance(value, str):
        return _from_roles([("user", value)])
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise Malformed(f"messages must be a list of {{role, content}} objects, not {value!r:.60}")
    return _from_roles([(m.get("role"), m.get("content")) for m in value])


def _parse_sharegpt(value: Any, _ref: Any) -> tuple[str | None, tuple[Turn, ...]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise Malformed(
            f"conversations must be a list of {{from, value}} objects, not {value!r:.60}"
        )
    pairs = []
    for k, m in enumerate(value):
        who = m.get("from")
        if who not in _SHAREGPT_ROLES:
            raise Malformed(
                f"message {k} is from {who!r}; ShareGPT roles are {', '.join(_SHAREGPT_ROLES)}"
            )
        pairs.append((_SHAREGPT_ROLES[who], m.get("value")))
    return _from_roles(pairs)


def _parse_turns(value: Any, _ref: Any) -> tuple[str | None, tuple[Turn, ...]]:
    if not isinstance(value, list) or not value:
        raise Malformed("turns must be a non-empty list of user messages")
    for k, t in enumerate(value):
        if not isinstance(t, str) or not t.strip():
            raise Malformed(f"turn {k} is empty")
    return None, tuple(Turn(t) for t in value)


def _parse_plain(value: Any, ref: Any) -> tuple[str | None, tuple[Turn, ...]]:
    if not isinstance(value, str) or not value.strip():
        raise Malformed("the prompt is empty")
    return None, (Turn(value, ref if isinstance(ref, str) else None),)


_PARSERS = {
    "messages": _parse_messages,
    "sharegpt": _parse_sharegpt,
    "turns": _parse_turns,
    "plain": _parse_plain,
}


# -- rendering --------------------------------------------------------------------------------


def messages_for(
    conv: Conversation, turn: int, answers: Sequence[str], *, drop: int = 0
) -> list[dict[str, str]]:
    """The chat messages that prompt turn `turn` (1-based): the system prompt, turns
    drop+1..turn-1 with `answers` (the target's own replies to them), then the user turn."""
    if not 1 <= turn <= len(conv.turns):
        raise ValueError(f"turn {turn} of a {len(conv.turns)}-turn conversation")
    if len(answers) < turn - 1:
        raise ValueError(f"turn {turn} needs {turn - 1} earlier answers, got {len(answers)}")
    msgs = [{"role": "system", "content": conv.system}] if conv.system else []
    for k in range(drop, turn - 1):
        msgs += [
            {"role": "user", "content": conv.turns[k].user},
            {"role": "assistant", "content": answers[k]},
        ]
    msgs.append({"role": "user", "content": conv.turns[turn - 1].user})
    return msgs


def template_kwargs(cfg: Any) -> dict[str, Any]:
    """`dataset.chat_template_kwargs` as a plain dict (checked: a mapping of names)."""
    raw = _get(cfg, "chat_template_kwargs") or {}
    if hasattr(raw, "items"):
        raw = dict(raw.items())
    else:
        raise ConfigError(
            f"dataset.chat_template_kwargs={raw!r} must be a mapping, e.g. {{enable_thinking: false}}"
        )
    try:  # an OmegaConf node inside: plain values, so the record and the template see the same
        from omegaconf import OmegaConf

        raw = {
            k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in raw.items()
        }
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return raw


def render(tokenizer: Any, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> str:
    """The chat template applied for a reply (generation prompt on), with the user's
    `chat_template_kwargs` (e.g. Qwen3's enable_thinking)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )


@dataclass(frozen=True)
class FittedTurn:
    """A turn's prompt fitted to a token budget, and what fitting cut."""

    text: str
    ids: list[int]
    dropped_turns: int  # oldest (user, answer) exchanges left out
    cut_tokens: int  # tokens cut from the front of the user turn itself (0 unless it alone is long)


def fit_turn(
    tokenizer: Any,
    conv: Conversation,
    turn: int,
    answers: Sequence[str],
    budget: int,
    kwargs: dict[str, Any],
) -> FittedTurn:
    """Turn `turn`'s prompt within `budget` tokens, keeping what matters: the system prompt and
    the template's header always stay; the oldest exchanges go first; a user turn that alone is
    over budget loses its own beginning (the question usually ends it)."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    for drop in range(turn):
        text = render(tokenizer, messages_for(conv, turn, answers, drop=drop), kwargs)
        ids = encode(text)
        if len(ids) <= budget:
            return FittedTurn(text, ids, drop, 0)
    user = encode(conv.turns[turn - 1].user)
    over = len(ids) - budget
    cut = over
    while cut < len(user):
        shorter = tokenizer.decode(user[cut:])
        trimmed = replace(conv, turns=(*conv.turns[: turn - 1], Turn(shorter)))
        text = render(tokenizer, messages_for(trimmed, turn, answers, drop=turn - 1), kwargs)
        ids = encode(text)
        if len(ids) <= budget:
            return FittedTurn(text, ids, turn - 1, cut)
        cut += max(1, len(ids) - budget)
    raise ConfigError(
        f"conversation {conv.index} ({conv.key}): the system prompt and the chat template alone "
        f"exceed the {budget}-token prompt budget: shorten the system prompt or lower "
        "max_new_tokens"
    )


# -- held-out split and mixtures --------------------------------------------------------------


def holdout_keys(keys: Sequence[str], share: float | None, count: int | None, seed: int) -> set:
    """The held-out conversations' keys: the `count` (or `share` of all, rounded, at least 1)
    keys ranked lowest by a seeded hash. Deterministic by conversation, never by row order."""
    unique = sorted(set(keys))
    if count is None:
        if share is None:
            return set()
        count = max(1, round(share * len(unique)))
    if count >= len(unique):
        raise ConfigError(
            f"dataset.holdout keeps {count} of {len(unique)} conversations back: nothing is "
            "left to train on; lower holdout.count or holdout.share"
        )
    ranked = sorted(unique, key=lambda k: hashlib.sha256(f"{seed}/{k}".encode()).digest())
    return set(ranked[:count])


def split_holdout(convs: Sequence[Conversation], cfg: Any, role: str) -> list[Conversation]:
    """The conversations of `role` (train: the rest; any other split: the held-out ones) under
    `dataset.holdout` {share | count, seed}; every conversation when no holdout is set."""
    node = _get(cfg, "holdout")
    if not node:
        return list(convs)
    share, count, seed = _get(node, "share"), _get(node, "count"), int(_get(node, "seed") or 0)
    if share is not None and not 0 < float(share) < 1:
        raise ConfigError(f"dataset.holdout.share={share} must be in (0, 1)")
    if count is not None and int(count) < 1:
        raise ConfigError(f"dataset.holdout.count={count} must be >= 1")
    held = holdout_keys(
        [c.key for c in convs],
        None if share is None else float(share),
        None if count is None else int(count),
        seed,
    )
    if holdout_side(role) == "train":
        return [c for c in convs if c.key not in held]
    return [c for c in convs if c.key in held]


def mixture_counts(weights: Sequence[float], available: Sequence[int], total: int) -> list[int]:
    """Rows drawn from each source: `total` shared in proportion to `weights` (largest
    remainders), each capped at what the source has (the shortfall is not refilled, so the
    weights stay true of what was drawn)."""
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"dataset.mixture weights {list(weights)} must be >= 0, some > 0")
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return [min(c, a) for c, a in zip(counts, available)]


def interleave(parts: Sequence[Sequence[Conversation]]) -> list[Conversation]:
    """One list from several sources, spread evenly (each source's rows at even strides), so a
    `limit`, a chunk or a shard of the mixture keeps its weights; indices renumbered."""
    keyed = []
    for s, part in enumerate(parts):
        n = len(part)
        keyed += [((k + 0.5) / n, s, k, conv) for k, conv in enumerate(part)]
    keyed.sort(key=lambda t: t[:3])
    return [replace(conv, index=i) for i, (*_, conv) in enumerate(keyed)]
