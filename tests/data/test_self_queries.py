"""`dataset.source: self` (data/self_queries.py): user queries sampled from the target after its
chat template's user header, filtered, cached and read as a `format: messages` set.

The toy target is no chat model, so the test template ends a user turn with " '", a token it
samples often (about 1 step in 30): most of its samples then "end their turn" within 48 tokens,
as SmolLM2-Instruct's end with <|im_end|>."""

from __future__ import annotations

import shutil
import threading
from collections import Counter

import pytest
from transformers import AutoTokenizer

from specdistill.data import self_queries as sq
from specdistill.data.prompts import check_prompt_settings, load_prompts
from specdistill.data.runtime import ConfigError
from tests.data.chat_fixtures import conversation, write_jsonl

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }} '{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def target(toy_tiny, tmp_path, monkeypatch, one_thread):
    """(target folder: the toy-tiny target saved with a chat tokenizer, that tokenizer); the
    query cache under this test's own SPECDISTILL_HOME."""
    folder = tmp_path / "target"
    shutil.copytree(toy_tiny.target_dir, folder)
    tok = AutoTokenizer.from_pretrained(toy_tiny.tokenizer_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    return str(folder), AutoTokenizer.from_pretrained(folder)


def node(**kw):
    return {"source": "self", "count": 8, "batch_size": 16, "max_query_tokens": 48, **kw}


def cache_files(tmp_path):
    return sorted((tmp_path / "home" / "self_queries").glob("*.jsonl"))


def no_model(*a, **k):
    raise AssertionError("the model was loaded")


# -- the filter, on scripted samples -----------------------------------------------------------


def test_keep_queries_drops_runaways_empties_duplicates_and_special_tokens():
    decode = lambda ids: "".join(chr(96 + t) for t in ids)  # noqa: E731  1 -> "a"
    rows = [[1, 2, 0, 5], [3, 3, 3], [9, 0], [0, 4], [1, 2, 0], [26, 7, 0], [5, 0]]
    seen: set[str] = set()
    kept, tally = sq.keep_queries(rows, {0}, decode, seen, special={7})
    assert kept == ["ab", "i", "e"]  # cut at the stop token, in order
    assert tally == Counter(kept=3, runaway=1, empty=1, duplicate=1, special=1)
    assert seen == {"ab", "i", "e"}


def test_collect_queries_stops_when_enough_and_refuses_too_few():
    s = sq.SelfSettings(count=5, batch_size=4)
    calls = []

    def sample(b):
        calls.append(b)
        return [[b + 1, k + 1, 0] for k in range(4)]  # 4 fresh queries a batch

    out = sq.collect_queries(sample, lambda ids: str(ids), {0}, s)
    assert len(out) == 5 and calls == [0, 1]
    runaway = lambda b: [[1, 2, 3]] * 4  # noqa: E731  never ends its turn
    with pytest.raises(ConfigError) as e:
        sq.collect_queries(runaway, str, {0}, s, field="dataset.mixture[1]")
    msg = str(e.value)
    assert "\n" not in msg and "dataset.mixture[1].count=5: only 0 queries kept" in msg
    assert "from 5 batches" in msg and "20 ran past dataset.mixture[1].max_query_tokens" in msg


# -- settings and errors before any model ------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"count": 0}, "dataset.count=0"),
        ({"count": None}, "dataset.count=None"),
        ({"sampling": {"temperature": 1.0, "top_p": 1.5}}, "dataset.sampling.top_p=1.5"),
        ({"sampling": {"temperature": 1.0, "top_p": 0}}, "dataset.sampling.top_p=0"),
        ({"sampling": {"temperature": 0}}, "dataset.sampling.temperature=0"),
        ({"temperature": 0.7}, "dataset.temperature was replaced by the one sampling spec"),
        ({"max_query_tokens": 0}, "dataset.max_query_tokens=0"),
    ],
)
def test_bad_settings_are_one_line_before_any_model(bad, field):
    with pytest.raises(ConfigError) as e:
        check_prompt_settings(node(**bad))
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_a_mixture_member_is_checked_by_its_own_field():
    cfg = {"source": "mixture", "mixture": [{"source": "jsonl"}, node(sampling={"top_p": 2})]}
    with pytest.raises(
        ConfigError, match=r"^dataset\.mixture\[1\]\.sampling\.top_p=2\.0 must lie in"
    ):
        check_prompt_settings(cfg)


def test_no_target_and_no_model_is_one_line(target):
    _, tok = target
    with pytest.raises(ConfigError) as e:
        load_prompts(node(), tok)
    assert str(e.value).startswith("dataset source 'self' samples queries from the target: ")
    assert "dataset.model" in str(e.value) and "\n" not in str(e.value)


# -- the toy target -------------------------------------------------------------------------


def test_rows_are_messages_with_the_system_prompt(target):
    path, tok = target
    rows = sq.self_query_rows(node(system="Be brief."), path, tok)
    assert [r["id"] for r in rows] == [f"self-{i}" for i in range(8)]
    for r in rows:
        system, user = r["messages"]
        assert system == {"role": "system", "content": "Be brief."} and user["role"] == "user"
        assert user["content"] == user["content"].strip() and user["content"]
    assert len({r["messages"][1]["content"] for r in rows}) == 8
    prompts = load_prompts(node(system="Be brief."), tok, target=path)
    assert len(prompts) == 8 and all(p.conversation.system == "Be brief." for p in prompts)
    first = rows[0]["messages"][1]["content"]
    assert prompts[0].text == f"<|system|>Be brief. '<|user|>{first} '<|assistant|>"


def test_same_settings_same_queries_and_the_cache_loads_no_model(target, tmp_path, monkeypatch):
    path, tok = target
    first = sq.self_query_rows(node(), path, tok)
    (cached,) = cache_files(tmp_path)
    cached.unlink()  # sampled afresh: the same queries
    assert sq.self_query_rows(node(), path, tok) == first
    monkeypatch.setattr(sq, "load_model", no_model)
    assert sq.self_query_rows(node(), path, tok) == first  # read back, no weights


def test_another_seed_is_another_key(target, tmp_path):
    path, tok = target
    a = sq.self_query_rows(node(), path, tok)
    b = sq.self_query_rows(node(seed=1), path, tok)
    assert len(cache_files(tmp_path)) == 2 and a != b


def test_runaways_can_leave_too_few_queries(target):
    path, tok = target  # one token: never a query and its end of turn
    with pytest.raises(ConfigError, match=r"^dataset\.count=8: only 0 queries kept from 2 "):
        sq.self_query_rows(node(max_query_tokens=1), path, tok)


def test_the_holdout_splits_self_queries_like_any_source(target):
    path, tok = target
    cfg = node(holdout={"count": 3, "seed": 0})
    train = [p.text for p in load_prompts(cfg, tok, target=path, default_split="train")]
    test = [p.text for p in load_prompts(cfg, tok, target=path, default_split="test")]
    assert len(train) == 5 and len(test) == 3 and not set(train) & set(test)
    again = [p.text for p in load_prompts(cfg, tok, target=path, default_split="test")]
    assert again == test


def test_a_mixture_draws_its_self_member_by_weight(target, tmp_path, monkeypatch):
    from specdistill.data.chat_prompts import member_nodes, prefetch_self_queries

    path, tok = target
    convs = write_jsonl(tmp_path / "c.jsonl", [conversation(k, 1) for k in range(12)])
    cfg = {
        "source": "mixture",
        "limit": 9,
        "mixture": [
            {"label": "files", "weight": 2, "source": "jsonl", "path": str(convs),
             "format": "messages", "field": "messages"},
            {"label": "self", **node()},
        ],
    }  # fmt: skip
    assert prefetch_self_queries(cfg, path, tok) == 1  # sampled here: the stage reads the cache
    monkeypatch.setattr(sq, "load_model", no_model)
    prompts = load_prompts(cfg, tok, target=path)
    assert Counter(p.source for p in prompts) == {"files": 6, "self": 3}
    assert member_nodes({**cfg, "seed": 3})[1]["seed"] == 3  # a self member's default seed


def test_online_streams_self_queries(target):
    from specdistill.distill.online.stream import load_sources, parse_stream

    path, tok = target
    (seg,) = parse_stream([{"dataset": node(), "requests": 4}])
    prompts = load_sources([seg], None, tok, target=path)[seg.label]
    assert len(prompts) == 8 and all(p.text.startswith("<|user|>") for p in prompts)


def test_two_processes_sample_once(target, monkeypatch):
    path, tok = target
    loads = []

    def counted(*a, **k):
        loads.append(1)
        return real(*a, **k)

    real = sq.load_model
    monkeypatch.setattr(sq, "load_model", counted)
    out = [None, None]

    def call(i):
        out[i] = sq.self_query_rows(node(), path, tok)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[1] and len(out[0]) == 8 and len(loads) == 1


def test_generate_samples_its_queries_from_the_resolved_target(
    target, toy_tiny, generate_cfg, tmp_path
):
    from datasets import load_from_disk

    from specdistill.data.generate import stage as gen

    path, _ = target  # pair.target, not a toy world (whose build would go to this test's home)
    overrides = [f"pair.target={path}", f"pair.tokenizer={path}", "pair.toy=null",
                 f"pair.drafter={toy_tiny.drafter_dir}", "dataset.source=self", "+dataset.count=4",
                 "+dataset.batch_size=16", "max_new_tokens=4", "threads=1"]  # fmt: skip
    gen.run(generate_cfg(*overrides))
    rows = load_from_disk(str(tmp_path / "gen"))
    assert len(rows) == 4 and all(p.startswith("<|user|>") for p in rows["prompt"])
    assert len(cache_files(tmp_path)) == 1


def test_generate_fills_the_cache_before_its_shard_processes(
    target, toy_tiny, generate_cfg, tmp_path, monkeypatch
):
    from specdistill.data.generate import stage as gen

    path, _ = target
    seen = []
    monkeypatch.setattr(gen, "run_local_processes", lambda cfg, n, run: seen.append(n))
    overrides = [f"pair.target={path}", f"pair.tokenizer={path}", "pair.toy=null",
                 f"pair.drafter={toy_tiny.drafter_dir}", "dataset.source=self", "+dataset.count=4",
                 "+dataset.batch_size=16", "processes=2"]  # fmt: skip
    gen.run(generate_cfg(*overrides))
    assert seen == [2] and len(cache_files(tmp_path)) == 1
