"""The generate stage's prompts, tokenised and fitted to the target's context.

The context comes from the target's config (no weights load), so a prompt set that cannot fit
(`max_new_tokens` leaving no room, every prompt empty or skipped) is refused before any model
loads. Long prompts follow `long_prompts`: truncate (keep the end, nearest the completion),
skip, or refuse the set (`error`). The benchmark (bench.py) fits its prompts with the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdistill.data.chat_prompts import is_conversation_set
from specdistill.data.conversations import Conversation, fit_turn
from specdistill.data.generate.batched import PreparedPrompt
from specdistill.data.generate.turns import prompt_head, row_index
from specdistill.data.prompts import Prompt, fit_to_context, load_prompts
from specdistill.data.runtime import ConfigError


@dataclass(frozen=True)
class ChatSet:
    """A chat set's conversations (by index), template arguments and most turns: what
    rendering its later turns needs (`data/generate/turns.py`)."""

    conversations: dict[int, Conversation]
    kwargs: dict[str, Any]
    max_turns: int


def chat_set(prompts: Sequence[Prompt]) -> ChatSet | None:
    """The prompts' ChatSet, or None for a plain (non-template) prompt set."""
    convs = {p.conversation.index: p.conversation for p in prompts if p.conversation}
    if not convs:
        return None
    kwargs = dict(next(p.template_kwargs for p in prompts if p.conversation))
    return ChatSet(convs, kwargs, max(len(c.turns) for c in convs.values()))


def context_length(model_config: Any, tokenizer: Any) -> int | None:
    """The target's context window, from its config (or the tokenizer's, if it is sane)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


def prompt_budget(context: int | None, max_new_tokens: int, max_prompt_tokens: int | None) -> int:
    """Most prompt tokens allowed so that prompt + completion fit the context."""
    room = None if context is None else context - max_new_tokens
    if room is not None and room < 1:
        raise ConfigError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's "
            f"{context}-token context: lower max_new_tokens"
        )
    if max_prompt_tokens is None:
        return room if room is not None else 10**9
    if max_prompt_tokens < 1 or (room is not None and max_prompt_tokens > room):
        raise ConfigError(
            f"max_prompt_tokens={max_prompt_tokens} must be in [1, {room}] (context {context} - "
            f"max_new_tokens {max_new_tokens}), or null for that maximum"
        )
    return max_prompt_tokens


def prepare_prompts(
    prompts: Sequence[Prompt], tokenizer: Any, budget: int, policy: str, add_special_tokens: bool
) -> tuple[list[PreparedPrompt], dict[str, int]]:
    """Tokenize; truncate (keep the end, nearest the completion; a chat prompt keeps its
    system prompt and header and loses the front of its user turn) or skip prompts over
    budget, or refuse the set (`error`). Chat prompts are numbered by row (turn 1's)."""
    out: list[PreparedPrompt] = []
    stats = {"total": len(prompts), "skipped_long": 0, "skipped_empty": 0, "truncated_long": 0}
    chat = chat_set(prompts)
    encoded = [
        tokenizer(p.text, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts
    ]
    if policy == "error":  # one line naming the count and the fix, before anything is written
        fit_to_context(encoded, budget, policy, context="the target's context leaves")
    for p, ids in zip(prompts, encoded):
        text = p.text
        if not ids:
            stats["skipped_empty"] += 1
            continue
        if len(ids) > budget:
            if policy == "skip":
                stats["skipped_long"] += 1
                continue
            if p.conversation is not None:
                fitted = fit_turn(tokenizer, p.conversation, 1, [], budget, dict(p.template_kwargs))
                text, ids = fitted.text, fitted.ids
            else:
                ids = ids[-budget:]
                text = tokenizer.decode(ids)
            stats["truncated_long"] += 1
        if chat is not None and p.conversation is not None:
            c = p.conversation
            head = prompt_head(tokenizer, c, chat.kwargs)
            index = row_index(c.index, 1, chat.max_turns)
            out.append(PreparedPrompt(index, text, list(ids), head=head, conversation=c.index))
        else:
            out.append(PreparedPrompt(p.index, text, list(ids)))
    return out, stats


def no_prompts_message(stats: dict[str, int], dataset_cfg: Any) -> str:
    """Why no prompt is left, from what `prepare_prompts` counted: an all-empty prompt file is
    not "too long", so the message names the reason that emptied the set (or both)."""
    field = dataset_cfg.get("field", "prompt")
    total, empty, long = stats["total"], stats["skipped_empty"], stats["skipped_long"]
    if empty == total:
        return (
            f"every one of the {total} prompts in dataset.field={field!r} is empty (no tokens): "
            "check dataset.path and dataset.field"
        )
    if long == total:
        return (
            f"every one of the {total} prompts exceeded the context with long_prompts=skip: "
            "use long_prompts=truncate or lower max_new_tokens"
        )
    return (
        f"no prompts left to generate: of {total}, {empty} are empty in "
        f"dataset.field={field!r} and {long} exceeded the context with long_prompts=skip; "
        "check dataset.path/field, or use long_prompts=truncate"
    )


def load_prepared_prompts(
    dataset_cfg: Any,
    tokenizer: Any,
    budget: int,
    split: str,
    policy: str,
    *,
    target: str | None = None,
) -> tuple[list[PreparedPrompt], dict[str, int], ChatSet | None]:
    """The stage's prompts (`dataset`, `split` when dataset.split is null), tokenised and fitted
    to `budget` under `long_prompts=policy` (the benchmark uses the same), and the chat set
    their later turns come from (None for plain prompts). `target`: the resolved target path."""
    prompts = load_prompts(dataset_cfg, tokenizer, default_split=split, target=target)
    prepared, stats = prepare_prompts(
        prompts, tokenizer, budget, policy, add_special_tokens=not is_chat(dataset_cfg)
    )
    return prepared, stats, chat_set(prompts)


def is_chat(dataset_cfg: Any) -> bool:
    """Chat prompts already hold the template's special tokens: add none when tokenizing."""
    if not is_conversation_set(dataset_cfg):
        return False
    return dataset_cfg.get("format") != "plain" or bool(dataset_cfg.get("chat", False))
