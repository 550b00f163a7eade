"""Multi-turn benchmark questions: turn k decoded after the target's own answers to turns < k.

MT-Bench's second question follows up on the model's first answer, so validate decodes turn 2
in the context the target itself would have produced: the target's greedy reply to turn 1
(plain target-only decoding, `max_new_tokens`), then turn 2 rendered with the chat template
after it (`data/chat_prompts.py::later_turn`). The context is the same in both serving modes,
so a sampled decode of turn 2 is measured on the prompt its greedy sibling sees.

`expand_turns` is pure orchestration: the caller supplies how to answer and how to fit, so the
stage uses the loaded target and the tests a scripted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdistill.data.chat_prompts import later_turn
from specdistill.data.prompt_record import Prompt

# (prompts) -> (prompts kept, their ids, a prompt_fit record): data/prompts.py::fit_prompt_set
Fit = Callable[[list[Prompt]], tuple[list[Prompt], list[list[int]], dict[str, Any]]]
# (fitted prompt ids) -> the target's reply to each, as text
Answer = Callable[[list[list[int]]], list[str]]


def expand_turns(
    prompts: list[Prompt], rows: list[list[int]], tok: Any, answer: Answer, fit: Fit
) -> tuple[list[Prompt], list[list[int]], dict[str, Any]]:
    """Turn-1 prompts (fitted, with their ids) plus every later turn of their conversations,
    each rendered after the target's answers to the turns before it; and the counts
    ({turns: {k: prompts}, prompt_fit of the later turns}). Prompts without a conversation,
    or with one turn, pass through."""
    out, out_rows = list(prompts), list(rows)
    counts: dict[int, int] = {1: len(prompts)}
    later_fit: dict[str, Any] = {}
    current = [(p, r) for p, r in zip(prompts, rows) if _turns(p) > 1]
    answers: dict[int, list[str]] = {id(p.conversation): [] for p, _ in current}
    turn = 1
    while current:
        replies = answer([r for _, r in current])
        for (p, _), reply in zip(current, replies, strict=True):
            answers[id(p.conversation)].append(reply)
        turn += 1
        nxt = [
            later_turn(tok, p, turn, answers[id(p.conversation)])
            for p, _ in current
            if _turns(p) >= turn
        ]
        if not nxt:
            break
        kept, kept_rows, fit_record = fit(nxt)
        _add(later_fit, fit_record)
        counts[turn] = len(kept)
        out += kept
        out_rows += kept_rows
        current = [(p, r) for p, r in zip(kept, kept_rows) if _turns(p) > turn]
    return out, out_rows, {"turns": counts, "later_fit": later_fit}


def _turns(p: Prompt) -> int:
    return len(p.conversation.turns) if p.conversation is not None else 1


def _add(total: dict[str, Any], record: dict[str, Any]) -> None:
    """Sum a prompt_fit record's counts into `total` (settings kept from the first)."""
    for k, v in record.items():
        if isinstance(v, int) and not isinstance(v, bool) and k != "max_prompt_tokens":
            total[k] = total.get(k, 0) + v
        else:
            total.setdefault(k, v)


def merge_fit(fit: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The stage's prompt_fit record over every turn: the later turns' counts added."""
    merged = dict(fit)
    for k in ("long", "truncated", "skipped", "chat_turns_cut"):
        if k in later:
            merged[k] = merged.get(k, 0) + later[k]
    return merged


def greedy_answers(
    target: Any, tok: Any, device: torch.device, max_new_tokens: int, eos: Sequence[int]
) -> Answer:
    """The target's greedy reply to each prompt, one at a time (no padding, so a reply is the
    same whatever else is in the set), cut at its first end-of-sequence token."""

    @torch.no_grad()
    def answer(rows: list[list[int]]) -> list[str]:
        replies = []
        for row in rows:
            ids = torch.tensor([row], device=device)
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(eos) or None,
                pad_token_id=tok.pad_token_id,
            )
            new = out[0, len(row) :].tolist()
            cut = next((i for i, t in enumerate(new) if t in eos), len(new))
            replies.append(tok.decode(new[:cut], skip_special_tokens=True).strip())
        return replies

    return answer
