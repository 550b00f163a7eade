"""The ready chat sets (conf/dataset/): they load from the offline copies, keep their weights and
categories, and no evaluation prompt is among the training prompts of the chat mixture."""

from __future__ import annotations

from collections import Counter

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.prompts import load_prompts
from tests.data.chat_fixtures import chat_tokenizer


@pytest.fixture(scope="module", autouse=True)
def scripted_self_queries():
    """chat_mix's `source: self` member without a chat model: `count` distinct scripted queries
    in its rows' form (data/self_queries.py samples them from the target; tested there)."""

    def rows(node, target, tokenizer, *, field="dataset"):
        n = int(node["count"])
        return [
            {"id": f"self-{i}", "messages": [{"role": "user", "content": f"Help me plan trip {i}"}]}
            for i in range(n)
        ]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("specdistill.data.self_queries.self_query_rows", rows)
        yield


@pytest.fixture(scope="module")
def tok(toy_tiny, tmp_path_factory):
    return chat_tokenizer(toy_tiny, tmp_path_factory.mktemp("chat-tok"))


def _set(name: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose("validate", overrides=[f"dataset={name}"]).dataset


def _user_turns(prompts) -> set[str]:
    return {t.user.strip() for p in prompts for t in p.conversation.turns}


@pytest.fixture(scope="module")
def training(tok):
    return load_prompts(_set("chat_mix"), tok, default_split="train")


def test_chat_mix_keeps_its_weights(training):
    assert len(training) == 1024
    weights = {"chat": 3, "instructions": 1, "gsm8k": 1, "code": 1}
    counts = Counter(p.source for p in training)
    assert set(counts) == set(weights)
    for label, w in weights.items():  # 1024 shared 3 : 1 : 1 : 1, rounding one either way
        assert abs(counts[label] - 1024 * w / 6) <= 1


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("chat_bench", "test"),
        ("mt_bench", "test"),
        ("gsm8k", "test"),
        ("chat_mix", "test"),
        ("instructions", "test"),
    ],
)
def test_no_evaluation_prompt_is_a_training_prompt(tok, training, name, split):
    evaluation = load_prompts(_set(name), tok, default_split=split)
    assert evaluation
    assert not _user_turns(evaluation) & _user_turns(training)


def test_chat_bench_covers_every_set_and_mt_bench_category(tok):
    prompts = load_prompts(_set("chat_bench"), tok, default_split="test")
    assert Counter(p.source for p in prompts) == {"mt_bench": 8, "gsm8k": 8, "code": 8}
    mt = [p for p in prompts if p.source == "mt_bench"]
    assert len({p.category for p in mt}) == 8 and all(len(p.conversation.turns) == 2 for p in mt)
