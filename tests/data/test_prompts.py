"""Prompt sources: toy, local files and chat templates, with clear errors on bad fields."""

from __future__ import annotations

import json

import pytest

from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError


def test_toy_prompts_have_references(toy_tiny):
    prompts = load_prompts({"source": "toy", "toy": "toy-tiny"}, default_split="test")
    assert len(prompts) >= 200
    assert [p.index for p in prompts] == list(range(len(prompts)))
    assert all(p.reference for p in prompts)


def test_jsonl_source_and_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(5))
    )
    cfg = {
        "source": "jsonl",
        "path": str(path),
        "field": "text",
        "reference_field": "answer",
        "limit": 3,
    }
    prompts = load_prompts(cfg)
    assert [(p.text, p.reference) for p in prompts] == [("q0", "a0"), ("q1", "a1"), ("q2", "a2")]


def test_bad_field_names_the_field_and_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "q"}) + "\n")
    with pytest.raises(ConfigError, match=r"dataset.field='prompt'.*\['text'\]"):
        load_prompts({"source": "jsonl", "path": str(path), "field": "prompt"})


def test_missing_file_and_empty_set(tmp_path):
    with pytest.raises(ConfigError, match="dataset.path"):
        load_prompts({"source": "jsonl", "path": str(tmp_path / "missing.jsonl")})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no rows"):
        load_prompts({"source": "jsonl", "path": str(empty)})
    with pytest.raises(ConfigError, match="dataset.source"):
        load_prompts({"source": "ftp"})


def test_chat_template_applied(toy_tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_tiny.target_dir)
    path = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    cfg = {"source": "jsonl", "path": str(path), "field": "messages", "chat": True}
    with pytest.raises(ConfigError, match="chat_template"):
        load_prompts(cfg, tok)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    [prompt] = load_prompts(cfg, tok)
    assert prompt.text == "<user>hi<assistant>"  # the trailing assistant turn is not prompted
