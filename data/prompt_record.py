"""The prompt record every stage reads (`data/prompts.py::load_prompts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdistill.data.conversations import Conversation


@dataclass(frozen=True)
class Prompt:
    """One prompt: its stable index in the source, text as the model sees it, a reference, and
    its context-length bucket (long prompt sets only) so reports can group by it.

    Chat sets (`data/chat_prompts.py`) also carry the conversation the prompt opens (`turn` 1;
    later turns are rendered after the target's own answers), the template arguments it was
    rendered with, its benchmark category and, in a mixture, the source it came from.
    """

    index: int
    text: str
    reference: str | None = None
    bucket: str | None = None
    category: str | None = None
    source: str | None = None
    conversation: Conversation | None = None
    turn: int = 1
    answers: tuple[str, ...] = ()  # the target's own replies to turns 1..turn-1, as rendered
    template_kwargs: tuple[tuple[str, Any], ...] = ()
