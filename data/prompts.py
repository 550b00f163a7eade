"""Prompt sources: a hub dataset, a local jsonl/parquet file, the toy world's code prompts,
long-context prompts bucketed by length (`source: long`, `specdistill.data.long_documents`), or
chat queries sampled from the target itself (`source: self`, `specdistill.data.self_queries`).

Every stage that needs prompts (generate, distill's on-policy and eval data, validate) reads
them through `load_prompts(cfg.dataset, tokenizer)`, so a source works everywhere once it works
here. Fields that do not exist and empty sets are reported before any model runs.
"""

from __future__ import annotations

from typing import Any

from specdistill.data.chat_prompts import chat_prompts, is_conversation_set, self_sources
from specdistill.data.dataset_rows import file_rows, hub_rows
from specdistill.data.prompt_record import Prompt
from specdistill.data.runtime import ConfigError, node_get
from specdistill.data.splits import stage_role

__all__ = ["Prompt", "check_prompt_settings", "fit_prompt_set", "fit_to_context", "load_prompts"]


_get = node_get


def load_prompts(
    cfg: Any, tokenizer=None, *, default_split: str = "train", target: str | None = None
) -> list[Prompt]:
    """Read prompts per the `dataset` config node; a stage passes its usual split as default
    and its resolved target path (`pair.target`; `source: self` samples its queries from it)."""
    source = _get(cfg, "source", "toy")
    split = stage_role(cfg, default_split)  # a role; the readers name the source's split
    if source == "mixture" or is_conversation_set(cfg):
        return chat_prompts(cfg, tokenizer, split, target=target)
    field = _get(cfg, "field", "prompt")
    ref_field = _get(cfg, "reference_field")
    if source == "toy":
        rows = _toy_rows(_get(cfg, "toy") or "toy-tiny", split)
        ref_field = ref_field or "completion"
    elif source == "toy_stream":
        rows = _toy_stream_rows(_get(cfg, "group"), _get(cfg, "stride") or 1)
        ref_field = ref_field or "completion"
    elif source == "long":
        from specdistill.data.long_documents import load_long_rows

        rows = load_long_rows(cfg, split, tokenizer)
        ref_field = ref_field or "completion"
    elif source == "hub":
        rows = hub_rows(cfg, split)
    elif source in ("jsonl", "json", "parquet", "csv"):
        rows = file_rows(cfg, source, split)
    else:
        raise ConfigError(
            f"dataset.source={source!r} is not known; use toy, toy_stream, long, hub, jsonl or "
            "parquet"
        )
    if not rows:
        raise ConfigError(
            f"dataset (source={source!r}, split={split!r}) has no rows: check dataset.path/name/split"
        )
    if field not in rows[0]:
        raise ConfigError(
            f"dataset.field={field!r} is not a column of the prompt set; columns are "
            f"{sorted(rows[0])}. Set dataset.field to one of them (or `messages` with chat: true)"
        )
    if ref_field and ref_field not in rows[0]:
        raise ConfigError(f"dataset.reference_field={ref_field!r} is not one of {sorted(rows[0])}")
    prompts = []
    for i, row in enumerate(rows):
        text = row[field]
        if not isinstance(text, str):
            raise ConfigError(
                f"dataset.field={field!r} holds {type(text).__name__} values, not text; "
                "for chat messages set dataset.format=messages (or sharegpt, turns)"
            )
        reference = row.get(ref_field) if ref_field else None
        prompts.append(Prompt(index=i, text=text, reference=reference, bucket=row.get("bucket")))
    limit = _get(cfg, "limit")
    if limit is not None:
        if int(limit) <= 0:
            raise ConfigError(f"dataset.limit={limit} must be positive (or null for all prompts)")
        prompts = prompts[: int(limit)]
    return prompts


def check_prompt_settings(cfg: Any) -> None:
    """Settings a source can check before any model loads (long sets' buckets and policy, self
    sources' count and sampling, in a mixture too), so a bad `dataset.bucket` is one error
    line, not one after a 30-second weight load."""
    if _get(cfg, "source") == "long":
        from specdistill.data.long_documents import long_settings

        long_settings(cfg)
    if _get(cfg, "source") in ("self", "mixture"):
        from specdistill.data.self_queries import SelfSettings

        for field, node in self_sources(cfg):
            SelfSettings.from_node(node, field)


def _toy_rows(name: str, split: str) -> list[dict]:
    """A toy world's prompts; its models are built only where the pair needs them."""
    from specdistill.data.toy.world import toy_prompts

    if split not in ("train", "test"):
        raise ConfigError(f"dataset.split={split!r}: the toy prompt set has splits train and test")
    return toy_prompts(name, split)


def _toy_stream_rows(group: Any, stride: Any) -> list[dict]:
    """Stdlib packages the toy world never saw (`data/toy/stream.py`): a second prompt
    distribution, so recipes are not tuned to the toy test split alone."""
    from specdistill.data.toy.stream import STREAM_GROUPS, group_prompts

    if group not in STREAM_GROUPS:
        raise ConfigError(f"dataset.group={group!r}: use one of {', '.join(STREAM_GROUPS)}")
    if not isinstance(stride, int) or stride < 1:
        raise ConfigError(f"dataset.stride={stride!r} must be a positive integer")
    return group_prompts(group)[::stride]


LONG_PROMPT_POLICIES = ("truncate", "skip", "error")


def check_long_prompts(policy: Any) -> str:
    """The `long_prompts` setting every stage shares: truncate (keep the end), skip, or error."""
    if policy not in LONG_PROMPT_POLICIES:
        raise ConfigError(
            f"long_prompts={policy!r} must be one of {', '.join(LONG_PROMPT_POLICIES)}"
        )
    return str(policy)


def fit_to_context(
    ids: list[list[int]], budget: int, policy: str, *, context: str
) -> tuple[list[int], list[list[int]], int]:
    """(kept row indices, their ids, how many were over budget) for prompts that must fit
    `budget` tokens: `truncate` keeps each long prompt's last `budget` tokens (those nearest
    the continuation), `skip` drops it, `error` refuses the set in one line. Never silent:
    callers log and record the count. `context` says where the budget comes from."""
    over = sum(len(row) > budget for row in ids)
    if over and policy == "error":
        longest = max(len(row) for row in ids)
        raise ConfigError(
            f"{over} of {len(ids)} prompts are longer than the {budget} prompt tokens {context} "
            f"(longest {longest}): set long_prompts=truncate (keep the end) or skip, choose "
            "shorter prompts (dataset.bucket), or lower max_new_tokens"
        )
    kept = [i for i, row in enumerate(ids) if policy != "skip" or len(row) <= budget]
    return kept, [ids[i][-budget:] for i in kept], over


def _fit_chat_turns(
    prompts: list[Prompt], ids: list[list[int]], tok: Any, policy: str, budget: int
) -> tuple[list[Prompt], list[list[int]], int]:
    """Long chat prompts under `truncate` re-rendered by `fit_turn` (system prompt and template
    header kept, oldest exchanges dropped first) instead of losing their beginning; how many."""
    if policy != "truncate":
        return prompts, ids, 0
    from dataclasses import replace

    from specdistill.data.conversations import fit_turn

    prompts, ids, cut = list(prompts), list(ids), 0
    for i, p in enumerate(prompts):
        if p.conversation is None or len(ids[i]) <= budget:
            continue
        fitted = fit_turn(tok, p.conversation, p.turn, p.answers, budget, dict(p.template_kwargs))
        prompts[i], ids[i], cut = replace(p, text=fitted.text), fitted.ids, cut + 1
    return prompts, ids, cut


def fit_prompt_set(
    prompts: list[Prompt], tok: Any, policy: str, budget: int, where: str
) -> tuple[list[Prompt], list[list[int]], dict[str, Any]]:
    """(prompts kept, their ids, a `prompt_fit` record) for a decoding stage (validate, bench):
    `fit_to_context` on the prompts' ids (no special tokens added), the count logged as a
    warning, so a long prompt is never silently wrapped. `where` says where `budget` comes from."""
    import logging

    ids = [tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    where = f"{where} and the verify's drafts"
    prompts, ids, chat_cut = _fit_chat_turns(prompts, ids, tok, policy, budget)
    kept, rows, over = fit_to_context(ids, budget, policy, context=where)
    over += chat_cut
    if not kept:
        raise ConfigError(
            f"every one of the {len(prompts)} prompts is longer than the {budget} prompt tokens "
            f"{where} with long_prompts=skip: use long_prompts=truncate, shorter prompts "
            "(dataset.bucket) or lower max_new_tokens"
        )
    fit: dict[str, Any] = {"policy": policy, "max_prompt_tokens": budget, "long": over}
    fit |= {"chat_turns_cut": chat_cut}
    fit |= {"truncated": over if policy == "truncate" else 0}
    fit |= {"skipped": over if policy == "skip" else 0}
    if over:
        done = "truncated to their last" if policy == "truncate" else "skipped: longer than"
        logging.getLogger(__name__).warning(
            "%d of %d prompts %s %d tokens (long_prompts=%s)", over, len(ids), done, budget, policy
        )
    return [prompts[i] for i in kept], rows, fit
