"""One training sequence (`Example`), apart from data.py so the lazy Seq-KD reader
(seqkd_rows.py) and data.py's collation both build on it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SEQKD_COLUMNS = ("prompt_ids", "completion_ids")


@dataclass(frozen=True)
class Example:
    """One training sequence; completion tokens are the ones the loss sees."""

    prompt_ids: list[int]
    completion_ids: list[int]
    # [completion tokens, K]: nested lists, or numpy views of the stored int32 / float16
    # columns for rows read from a Seq-KD dataset (seqkd_rows.py)
    topk_ids: Any = None
    topk_logprobs: Any = None
    prompt_head: int = 0  # a chat row's system prompt + header tokens: a cut keeps them
