"""Conversations: every reader, one-line errors for malformed rows, rendering with template
arguments, truncation that keeps the system prompt, the held-out split, mixtures."""

from __future__ import annotations

import json

import pytest

from specdistill.data.conversations import (
    Conversation,
    Turn,
    fit_turn,
    holdout_keys,
    interleave,
    messages_for,
    mixture_counts,
    read_conversations,
)
from specdistill.data.local_data import local_data_dir, resolve_path
from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError
from tests.data.chat_fixtures import chat_tokenizer, conversation, write_jsonl


@pytest.fixture(scope="module")
def chat_tok(toy_tiny, tmp_path_factory):
    return chat_tokenizer(toy_tiny, tmp_path_factory.mktemp("chat-tok"))


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_messages_reader_keeps_system_and_pairs_answers():
    rows = [
        {
            "messages": _msgs(
                ("system", "S"),
                ("user", "a"),
                ("assistant", "b"),
                ("user", "c"),
                ("assistant", "d"),
            )
        }
    ]
    (conv,), skipped = read_conversations(rows, {"format": "messages"})
    assert skipped == 0 and conv.system == "S"
    assert conv.turns == (Turn("a", "b"), Turn("c", "d"))


def test_sharegpt_reader_maps_roles():
    rows = [
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "yo"},
            ],
        }
    ]
    (conv,), _ = read_conversations(rows, {"format": "sharegpt", "id_field": "id"})
    assert conv.key == "x" and conv.system == "S" and conv.turns == (Turn("hi", "yo"),)


def test_turns_and_plain_readers():
    (mt,), _ = read_conversations(
        [{"turns": ["q1", "q2"], "category": "math"}],
        {"format": "turns", "category_field": "category"},
    )
    assert mt.turns == (Turn("q1"), Turn("q2")) and mt.category == "math"
    (plain,), _ = read_conversations(
        [{"question": "2+2?", "answer": "4"}],
        {"format": "plain", "field": "question", "reference_field": "answer"},
    )
    assert plain.turns == (Turn("2+2?", "4"),) and plain.system is None


def test_the_real_sharegpt_fixture_reads_every_conversation():
    path = local_data_dir() / "sharegpt" / "dummy_conversation.json"
    rows = json.loads(path.read_text())
    convs, skipped = read_conversations(rows, {"format": "sharegpt", "id_field": "id"})
    assert skipped == 0 and len(convs) == len(rows) == 500
    assert max(len(c.turns) for c in convs) >= 3


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        (_msgs(("user", "a"), ("robot", "b")), "role 'robot'"),
        (_msgs(("user", "a"), ("assistant", " ")), "message 1 (assistant) is empty"),
        (_msgs(("user", "a"), ("user", "b")), "an assistant answer is expected between them"),
        (_msgs(("user", "a"), ("assistant", "b"), ("user", "c")), "ends in a user turn"),
        (_msgs(("user", "a"), ("system", "S")), "system prompt after the first message"),
        (
            _msgs(
                ("assistant", "b"),
            ),
            "no user turn before it",
        ),
    ],
)
def test_malformed_conversation_is_one_error_line_or_skipped(messages, says):
    rows = [{"messages": _msgs(("user", "fine"))}, {"messages": messages}]
    with pytest.raises(ConfigError) as e:
        read_conversations(rows, {"format": "messages"})
    msg = str(e.value)
    assert "\n" not in msg and says in msg and "dataset row 1" in msg and "malformed=skip" in msg
    convs, skipped = read_conversations(rows, {"format": "messages", "malformed": "skip"})
    assert len(convs) == 1 and skipped == 1


def test_template_kwargs_reach_the_rendered_prompt(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(0, 1, system="Be brief.")])
    cfg = {"source": "jsonl", "path": str(path), "format": "messages"}
    (plain,) = load_prompts(cfg, chat_tok)
    (think,) = load_prompts({**cfg, "chat_template_kwargs": {"think": True}}, chat_tok)
    assert plain.text.startswith("<|system|>Be brief.\n<|user|>def f0_0")
    assert plain.text.endswith("<|assistant|>") and think.text.endswith("<|assistant|><think>")
    assert dict(think.template_kwargs) == {"think": True} and think.conversation is not None


def test_truncation_drops_oldest_turns_and_keeps_the_system_prompt(chat_tok):
    conv = Conversation(
        0,
        "k",
        tuple(Turn(f"question {t} " + "word " * 40) for t in range(4)),
        system="SYSTEM PROMPT",
    )
    answers = ["answer " * 30 for _ in range(3)]
    whole = fit_turn(chat_tok, conv, 4, answers, 10**6, {})
    assert whole.dropped_turns == 0 and "question 0" in whole.text
    budget = len(whole.ids) - 20
    cut = fit_turn(chat_tok, conv, 4, answers, budget, {})
    assert len(cut.ids) <= budget and cut.dropped_turns == 1
    assert cut.text.startswith("<|system|>SYSTEM PROMPT\n") and "question 0" not in cut.text
    assert "question 1" in cut.text and cut.text.endswith("<|assistant|>")
    # a last turn that alone is over budget: every older turn goes, then its own front
    bare = Conversation(0, "k", (Turn("x"),), system="SYSTEM PROMPT")
    budget = len(fit_turn(chat_tok, bare, 1, [], 10**6, {}).ids) + 8
    tiny = fit_turn(chat_tok, conv, 4, answers, budget, {})
    assert len(tiny.ids) <= budget and tiny.dropped_turns == 3 and tiny.cut_tokens > 0
    assert tiny.text.startswith("<|system|>SYSTEM PROMPT\n<|user|>")


def test_messages_for_uses_the_given_answers():
    conv = Conversation(0, "k", (Turn("a", "ref a"), Turn("b", "ref b")), system="S")
    assert messages_for(conv, 2, ["mine"]) == _msgs(
        ("system", "S"), ("user", "a"), ("assistant", "mine"), ("user", "b")
    )


def test_holdout_is_deterministic_by_conversation_and_disjoint(chat_tok, tmp_path):
    rows = [conversation(k, 1) for k in range(50)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = {
        "source": "jsonl",
        "path": str(path),
        "format": "messages",
        "id_field": "id",
        "holdout": {"share": 0.1, "seed": 3},
    }
    train = load_prompts(cfg, chat_tok, default_split="train")
    test = load_prompts(cfg, chat_tok, default_split="test")
    keys = lambda ps: {p.conversation.key for p in ps}  # noqa: E731
    assert len(test) == 5 and len(train) == 45 and not keys(train) & keys(test)
    # reordering the file moves no conversation across the split
    write_jsonl(path, rows[::-1])
    assert keys(load_prompts(cfg, chat_tok, default_split="test")) == keys(test)
    assert holdout_keys(["a", "b", "c"], None, 2, 0) == holdout_keys(["c", "b", "a"], None, 2, 0)
    with pytest.raises(ConfigError, match="nothing is left to train on"):
        holdout_keys(["a", "b"], None, 2, 0)


def test_mixture_counts_follow_the_weights():
    assert mixture_counts([3, 1], [1000, 1000], 100) == [75, 25]
    assert mixture_counts([1, 1, 1], [10, 10, 10], 10) == [4, 3, 3]  # largest remainders
    assert mixture_counts([1, 1], [5, 100], 40) == [5, 20]  # capped, not refilled
    with pytest.raises(ConfigError):
        mixture_counts([0, 0], [1, 1], 2)


def test_mixture_of_two_sources_interleaves_by_weight(chat_tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [conversation(k, 1) for k in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"q": f"what is {k}?", "a": str(k)} for k in range(40)])
    cfg = {
        "source": "mixture",
        "limit": 20,
        "mixture": [
            {"label": "code", "weight": 3, "source": "jsonl", "path": str(a), "format": "messages"},
            {
                "label": "math",
                "weight": 1,
                "source": "jsonl",
                "path": str(b),
                "format": "plain",
                "field": "q",
                "reference_field": "a",
                "chat": True,
            },
        ],
    }
    prompts = load_prompts(cfg, chat_tok)
    sources = [p.source for p in prompts]
    assert sources.count("code") == 15 and sources.count("math") == 5
    assert [p.index for p in prompts] == list(range(20))
    assert sources[:4].count("math") <= 1 and "math" in sources[:8]  # spread, not appended
    assert all(p.category == p.source for p in prompts)
    math = next(p for p in prompts if p.source == "math")
    assert math.text.startswith("<|user|>what is") and math.reference is not None


def test_interleave_spreads_each_source_evenly():
    parts = [
        [Conversation(i, f"a{i}", (Turn("x"),)) for i in range(6)],
        [Conversation(i, f"b{i}", (Turn("y"),)) for i in range(2)],
    ]
    keys = [c.key for c in interleave(parts)]
    assert keys == ["a0", "a1", "b0", "a2", "a3", "a4", "b1", "a5"]


def test_local_paths_resolve_into_the_packaged_copies():
    assert resolve_path("local:gsm8k/test.jsonl").endswith("gsm8k/test.jsonl")
    assert resolve_path("/x/y.jsonl") == "/x/y.jsonl"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_path("local:nope.jsonl")


def test_generate_regenerates_every_turn_in_order(toy_tiny, generate_cfg, tmp_path):
    """A 3-turn conversation yields 3 rows, turn k's prompt holding the target's own replies to
    turns 1..k-1 (never the source's answers); a resumed run finds every turn done."""
    import datasets

    from specdistill.data.generate import stage as gen

    tok_dir = tmp_path / "tok"
    tok = chat_tokenizer(toy_tiny, tok_dir)
    rows = [conversation(0, 3, system="SYS"), conversation(1, 1), conversation(2, 2)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    overrides = [
        f"pair.tokenizer={tok_dir}",
        "dataset.source=jsonl",
        f"+dataset.path={path}",
        "+dataset.format=messages",
        "dataset.field=messages",
        "+dataset.chat_template_kwargs={think: true}",
        "chunk_size=2",
        "max_new_tokens=8",
    ]
    res = gen.run(generate_cfg(*overrides))
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    assert res.samples == 6 == ds.num_rows
    by = {(r["conversation_index"], r["turn"]): r for r in ds}
    assert sorted(by) == [(0, 1), (0, 2), (0, 3), (1, 1), (2, 1), (2, 2)]
    for c in (0, 2):
        for t in range(2, len(rows[c]["messages"]) // 2 + 1):
            prompt = by[(c, t)]["prompt"]
            for k in range(1, t):
                reply = by[(c, k)]["completion"]
                assert (
                    f"<|assistant|><think>{reply}" not in prompt
                )  # a new turn, not a generation prompt
                assert f"<|assistant|>{reply}\n" in prompt
            assert "someone else's answer" not in prompt
            assert prompt.endswith("<|assistant|><think>")
            assert by[(c, t)]["prompt_ids"] == tok(prompt, add_special_tokens=False).input_ids
    assert by[(0, 3)]["prompt"].startswith("<|system|>SYS\n")
    assert by[(0, 1)]["prompt_head"] == len(
        tok("<|system|>SYS\n", add_special_tokens=False).input_ids
    )
    config = json.loads(ds.info.description)
    assert config["chat_turns"] == 3 and config["chat_template_kwargs"] == {"think": True}
    again = gen.run(generate_cfg(*overrides))
    assert again.chunks_generated == 0 and again.samples == 6


def test_an_evaluation_set_overlapping_the_training_rows_is_refused(
    toy_tiny, generate_cfg, tmp_path
):
    from specdistill.data.generate import stage as gen
    from specdistill.data.heldout_check import check_disjoint

    tok_dir = tmp_path / "tok"
    tok = chat_tokenizer(toy_tiny, tok_dir)
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(k, 1) for k in range(12)])
    cfg = {
        "source": "jsonl",
        "path": str(path),
        "format": "messages",
        "id_field": "id",
        "holdout": {"count": 3},
    }
    overrides = [
        f"pair.tokenizer={tok_dir}",
        "dataset.source=jsonl",
        f"+dataset.path={path}",
        "+dataset.format=messages",
        "dataset.field=messages",
        "+dataset.id_field=id",
        "+dataset.holdout={count: 3}",
        "dataset.limit=null",
    ]
    gen.run(generate_cfg(*overrides))
    heldout = load_prompts(cfg, tok, default_split="test")
    assert check_disjoint(heldout, tmp_path / "gen") == 9
    with pytest.raises(ConfigError) as e:
        check_disjoint(
            load_prompts(cfg, tok, default_split="train")[:2] + heldout, tmp_path / "gen"
        )
    assert "2 of 5 evaluation prompts" in str(e.value) and "\n" not in str(e.value)
