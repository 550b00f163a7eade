"""Long-context prompt sets (`dataset.source=long`): buckets, the held-out split by module,
determinism, cuts at a definition (code) or paragraph (text) boundary, the question variant.

Counted with the toy-tiny tokenizer (512 tokens: ~2.5 characters a token), so stdlib modules
span every bucket below; buckets are small to keep the tests to seconds.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap

import pytest

from specdistill.data.long_documents import (
    file_documents,
    long_rows,
    long_settings,
    stdlib_documents,
)
from specdistill.data.long_prompts import (
    Bucket,
    bucket_of,
    code_cuts,
    paragraph_cuts,
    parse_buckets,
    split_at,
)
from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.data.toy.corpus import corpus_files, is_held_out, stdlib_dir
from specdistill.data.toy.world import toy_prompts

SMALL = {"source": "long", "buckets": ["0-256", "256-1k", "1k-2k"], "per_bucket": 3}


@pytest.fixture(scope="module")
def tok(toy_tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_tiny.tokenizer_dir)


@pytest.fixture(scope="module")
def test_docs():
    return stdlib_documents("test")


@pytest.fixture(scope="module")
def rows(tok, test_docs):
    return long_rows(test_docs, tok, long_settings(SMALL))


# ----------------------------------------------------------------------------- buckets


def test_bucket_bounds_lo_exclusive_hi_inclusive():
    buckets = parse_buckets(None)  # the default: 0-512, 512-2k, 2k-4k, 4k-8k
    assert [(b.lo, b.hi) for b in buckets] == [(0, 512), (512, 2048), (2048, 4096), (4096, 8192)]
    assert bucket_of(1, buckets).name == "0-512"
    assert bucket_of(512, buckets).name == "0-512"
    assert bucket_of(513, buckets).name == "512-2k"
    assert bucket_of(2048, buckets).name == "512-2k"
    assert bucket_of(2049, buckets).name == "2k-4k"
    assert bucket_of(8192, buckets).name == "4k-8k"
    assert bucket_of(8193, buckets) is None
    assert parse_buckets(["0-512"], bucket="4K-8k") == (Bucket("4K-8k", 4096, 8192),)


@pytest.mark.parametrize(
    "buckets,bucket,field",
    [
        (["0-512", "4k-2k"], None, "dataset.buckets[1]='4k-2k'"),
        (["0-512", "abc"], None, "dataset.buckets[1]='abc'"),
        (["1-2-3"], None, "dataset.buckets[0]='1-2-3'"),
        (["0-1k", "512-2k"], None, "dataset.buckets[1]='512-2k' overlaps"),
        (["2k-4k", "0-512"], None, "dataset.buckets[1]='0-512' overlaps or precedes"),
        ([], None, "dataset.buckets=[]"),
        ("0-512", None, "dataset.buckets='0-512'"),
        (None, "8k-4k", "dataset.bucket='8k-4k'"),
        (None, "4k", "dataset.bucket='4k'"),
    ],
)
def test_bad_bucket_specs_name_the_field(buckets, bucket, field):
    with pytest.raises(ConfigError) as err:
        long_settings({"buckets": buckets, "bucket": bucket})
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "settings,field",
    [
        ({"per_bucket": 0}, "dataset.per_bucket=0"),
        ({"max_tokens": 256, "buckets": ["0-256", "256-1k"]}, "dataset.max_tokens=256"),
        ({"documents": "web"}, "dataset.documents='web'"),
        ({"task": "chat"}, "dataset.task='chat'"),
        ({"kind": "prose"}, "dataset.kind='prose'"),
    ],
)
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.")):
        long_settings(settings)


def test_rows_land_in_their_bucket_by_exact_target_tokens(rows, tok):
    buckets = {b.name: b for b in parse_buckets(SMALL["buckets"])}
    assert {r["bucket"] for r in rows} == set(buckets)
    for r in rows:
        n = len(tok(r["prompt"], add_special_tokens=False).input_ids)
        assert r["tokens"] == n and buckets[r["bucket"]].holds(n), (r["bucket"], n)
    # per_bucket from different modules first, and bucket-interleaved order
    assert [r["bucket"] for r in rows[:3]] == ["0-256", "256-1k", "1k-2k"]
    for name in buckets:
        mods = [r["module"] for r in rows if r["bucket"] == name]
        assert len(mods) == 3 and len(set(mods)) == 3


def test_counting_a_whole_module_raises_no_false_length_alarm(toy_tiny, test_docs):
    """A module is meant to be longer than the model's positions: counting it must not print
    `transformers`' "... will result in indexing errors" warning (a fresh tokenizer each time:
    transformers warns once per instance)."""
    import logging

    from transformers import AutoTokenizer

    from specdistill.data.long_prompts import count_tokens, prefix_counter

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")  # the library's loggers stop there (no propagate)
    root.addHandler(handler)
    try:
        text = max((text for _, text in test_docs), key=len)
        for count in (count_tokens, lambda t, k: prefix_counter(t, k)(len(t))):
            tok = AutoTokenizer.from_pretrained(toy_tiny.tokenizer_dir, model_max_length=64)
            assert count(text, tok) > 64
    finally:
        root.removeHandler(handler)
    assert not [r for r in records if "sequence length" in r.getMessage()]


def test_max_tokens_caps_the_prompts(tok, test_docs):
    s = long_settings(SMALL | {"buckets": ["0-256", "256-1k"], "max_tokens": 500})
    got = long_rows(test_docs, tok, s)
    assert {r["bucket"] for r in got} == {"0-256", "256-1k"} and len(got) == 6
    assert all(r["tokens"] <= 500 for r in got)


# ----------------------------------------------------------------------------- split


def test_modules_are_held_out_with_the_toy_worlds_split(rows, test_docs):
    base = stdlib_dir()
    train_paths, held_paths = corpus_files()
    held = {p.relative_to(base).as_posix() for p in held_paths}
    train = {m for m, _ in stdlib_documents("train")}
    assert {m for m, _ in test_docs} <= held and not train & held
    assert train <= {p.relative_to(base).as_posix() for p in train_paths}
    assert len(held) - len(test_docs) <= 2  # only empty files (e.g. __init__) dropped
    assert all(is_held_out(m) for m in held) and not any(is_held_out(m) for m in train)
    assert {r["module"] for r in rows} <= held
    toy_test = {r["module"] for r in toy_prompts("toy-tiny", "test")}
    assert toy_test <= held  # the toy world's test prompts come from the same modules


def test_selection_is_deterministic_and_seeded(rows, tok, test_docs):
    again = long_rows(test_docs, tok, long_settings(SMALL))
    assert again == rows
    other = long_rows(test_docs, tok, long_settings(SMALL | {"seed": 1}))
    key = [(r["module"], r["offset"]) for r in rows]
    assert [(r["module"], r["offset"]) for r in other] != key


# ----------------------------------------------------------------------------- cuts


def _first_block(continuation: str) -> ast.stmt:
    """The definition the continuation starts, found by `inspect.getblock` (tokenize), not by
    the ast line numbers the cutter used."""
    lines = continuation.lstrip("\r\n").splitlines(keepends=True)
    block = "".join(inspect.getblock(lines))
    return ast.parse(textwrap.dedent(block)).body[0]


def test_cut_lands_at_a_definition(rows):
    sources = {m: t for m, t in stdlib_documents("test")}
    for r in rows:
        text = sources[r["module"]]
        prompt, continuation = text[: len(r["prompt"])], text[len(r["prompt"]) :]
        assert prompt == r["prompt"] and prompt == prompt.rstrip()
        assert continuation.startswith(r["completion"])
        node = _first_block(continuation)
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        assert r["name"].split(".")[-1] == node.name


def test_code_cuts_cover_methods_and_nested_defs_and_skip_one_liners():
    text = (
        "import os\n\n\nclass A:\n    x = 1\n\n    @property\n    def f(self):\n"
        "        def g():\n            return 1\n        return g()\n\n"
        "async def h():\n    pass\nclass B: pass\n"
    )
    cuts = code_cuts(text)
    assert [(c.name, c.kind) for c in cuts] == [
        ("A", "class"),
        ("A.f", "def"),
        ("A.f.g", "def"),
        ("h", "def"),
        ("B", "class"),
    ]
    prompt, cont = split_at(text, cuts[1])
    assert prompt.endswith("@property") and cont == text[len(prompt) :]
    assert cont.lstrip().startswith("def f(self):")
    assert code_cuts("def broken(:\n") is None
    assert code_cuts("x = 1\n\x0c\ndef f():\n    pass\n")[0].offset == len("x = 1\n\x0c\n")


def test_text_documents_cut_at_paragraphs_and_split_by_key(tmp_path, tok):
    para = " ".join(["word"] * 60)
    docs = [
        {"id": f"doc-{i}", "body": "\n\n".join(f"{i}.{j} {para}" for j in range(12))}
        for i in range(60)
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = {"source": "long", "documents": "jsonl", "path": str(path), "document_field": "body"}
    cfg |= {"id_field": "id", "kind": "text", "buckets": ["0-300", "300-1k"], "per_bucket": 4}
    for split in ("train", "test"):
        keys = {k for k, _ in file_documents(long_settings(cfg), split)}
        assert keys == {d["id"] for d in docs if is_held_out(d["id"]) == (split == "test")}
    got = load_prompts(cfg, tok, default_split="test")
    assert got and {p.bucket for p in got} == {"0-300", "300-1k"}
    held = {d["id"]: d["body"] for d in docs if is_held_out(d["id"])}
    for p in got:
        body = next(b for b in held.values() if b.startswith(p.text))
        assert body[len(p.text) :].startswith("\n\n") and p.reference.lstrip()[0].isdigit()
    assert paragraph_cuts("a\n\n\nb\nc\n\nd")[0].name == "L4"


def test_question_variant_asks_about_a_function_in_the_prompt(tok, test_docs):
    s = long_settings(SMALL | {"task": "question", "buckets": ["1k-4k"], "per_bucket": 4})
    got = long_rows(test_docs, tok, s)
    assert got and all(r["task"] == "question" for r in got)
    for r in got:
        assert r["prompt"].endswith("# Answer:")
        name = r["prompt"].rsplit("# Question: what does `", 1)[1].split("`")[0]
        assert f"def {name}(" in r["prompt"] and r["completion"].strip()


def test_long_source_needs_the_tokenizer_and_a_known_split():
    with pytest.raises(ConfigError, match="pair's tokenizer"):
        load_prompts(SMALL, None, default_split="test")
    with pytest.raises(ConfigError, match=r"^dataset\.split='validation'"):
        load_prompts(SMALL | {"split": "validation"}, object())


def test_generate_runs_unchanged_on_long_prompts(generate_cfg, tmp_path, tok):
    """The generate stage on `dataset=stdlib-long` (train split): its rows' prompts are the set's
    prompts, and the one past toy-tiny's context is truncated to its end and counted."""
    import datasets

    from specdistill.data.generate import stage as gen

    extra = ("dataset=stdlib-long", "dataset.buckets=[0-256,1k-2k]", "dataset.per_bucket=1")
    cfg = generate_cfg(*extra, "dataset.limit=null")
    res = gen.run(cfg)
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    prompts = load_prompts(cfg.dataset, tok, default_split="train")
    assert res.merged and ds.num_rows == 2 and [p.bucket for p in prompts] == ["0-256", "1k-2k"]
    assert ds["prompt"][0] == prompts[0].text
    assert prompts[1].text.endswith(ds["prompt"][1][-200:])  # kept the end
    result = json.loads((tmp_path / "gen" / "result.json").read_text())
    assert result["truncated_long_prompts"] == 1
