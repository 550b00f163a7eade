"""A chat template on the toy tokenizer, and small conversation files, for the chat tests."""

from __future__ import annotations

import json
from pathlib import Path

# Renders every message as <|role|>content and the reply's header; `think` (a template
# argument, like Qwen3's enable_thinking) adds a marker the tests can look for.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if think is defined and think %}<think>"
    "{% endif %}{% endif %}"
)


def chat_tokenizer(toy_world, folder: Path):
    """The toy-tiny tokenizer with TEMPLATE, saved to `folder` (a `pair.tokenizer` path)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_world.tokenizer_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversation(k: int, turns: int, system: str | None = None) -> dict:
    """OpenAI messages: `turns` answered user turns (the source's answers are not the target's)."""
    msgs = [{"role": "system", "content": system}] if system else []
    for t in range(turns):
        msgs += [
            {"role": "user", "content": f'def f{k}_{t}(x):\n    """Return x plus {t}."""'},
            {"role": "assistant", "content": f"someone else's answer {k}.{t}"},
        ]
    return {"id": f"c{k}", "messages": msgs}
