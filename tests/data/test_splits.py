"""One split rule (data/splits.py) for the readers and the plan's held-out check
(data/heldout_check.py): a role becomes the source's split, its file and its held-out side, and
two nodes share rows only where the same source and split are not cut apart by one holdout."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.data.chat_prompts import source_conversations
from specdistill.data.dataset_rows import file_rows, hub_rows
from specdistill.data.heldout_check import RowSide, row_sides, shared_rows, shares_rows, why_shared
from specdistill.data.runtime import ConfigError
from specdistill.data.splits import read_split, source_split, split_path

HUB = {"source": "hub", "name": "ORG/chat", "field": "messages", "chat": True}


def _set(name: str) -> dict:
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        node = compose("validate", overrides=[f"dataset={name}"]).dataset
    return OmegaConf.to_container(node, resolve=False)  # type: ignore[return-value]


@pytest.fixture
def hub_splits(monkeypatch) -> list[str]:
    """The splits `datasets.load_dataset` is asked for (one conversation per split name)."""
    import datasets

    asked: list[str] = []

    def load_dataset(name, config=None, *, split, revision=None):
        asked.append(split)
        return [{"messages": [{"role": "user", "content": f"{split} {i}"}]} for i in range(10)]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


def test_roles_map_to_the_sources_split_names():
    node = {**HUB, "splits": {"train": "train_sft", "test": "test_sft"}}
    assert (source_split(node, "train"), source_split(node, "test")) == ("train_sft", "test_sft")
    assert source_split(node, "validation") == "validation"  # a name not listed is itself
    assert source_split(HUB, "test") == "test"
    with pytest.raises(ConfigError, match=r"dataset.splits='x' must map roles"):
        source_split({**HUB, "splits": "x"}, "test")


def test_a_holdout_reads_the_split_it_is_cut_from():
    assert read_split({"holdout": {"count": 2}}, "test") == "train"
    assert read_split({"holdout": {"count": 2, "from_split": "train_sft"}}, "test") == "train_sft"
    assert read_split({}, "test") == "test"


def test_a_path_per_split_picks_the_file_and_names_a_missing_one():
    node = {"source": "jsonl", "path": {"train": "a.jsonl", "test": "b.jsonl"}}
    assert (split_path(node, "train"), split_path(node, "test")) == ("a.jsonl", "b.jsonl")
    assert split_path({"path": "one.jsonl"}, "test") == "one.jsonl"
    with pytest.raises(
        ConfigError, match=r"no file for split 'validation'.*dataset.path.validation"
    ):
        split_path(node, "validation")


def test_ultrachat_trains_on_train_sft_and_holds_out_test_sft(hub_splits):
    node = _set("ultrachat")
    hub_rows(node, "train")
    source_conversations(node, "test", label=None)  # distill's eval and validate
    assert hub_splits == ["train_sft", "test_sft"]
    held = {**node, "holdout": {"count": 3, "seed": 0, "from_split": "train_sft"}}
    test = source_conversations(held, "test", label=None)
    train = source_conversations(held, "train", label=None)
    assert hub_splits[2:] == ["train_sft", "train_sft"]
    assert len(test) == 3 and len(train) == 7 and not {c.key for c in test} & {c.key for c in train}


def test_gsm8k_reads_its_train_file_for_training_and_its_test_file_for_evaluation():
    node = _set("gsm8k")
    train = {r["question"] for r in file_rows(node, "jsonl", "train")}
    test = {r["question"] for r in file_rows(node, "jsonl", "test")}
    assert train and test and not train & test


def test_rows_are_shared_unless_one_holdout_puts_them_on_opposite_sides():
    whole = RowSide("hub ORG/chat", "train_sft", "", "all")
    train = RowSide("hub ORG/chat", "train_sft", "{count: 8}", "train")
    held = RowSide("hub ORG/chat", "train_sft", "{count: 8}", "held")
    other_cut = RowSide("hub ORG/chat", "train_sft", "{count: 9}", "held")
    assert shares_rows(whole, whole) and "no dataset.holdout" in why_shared(whole, whole)
    assert not shares_rows(train, held)
    assert shares_rows(train, train) and "both read the train side" in why_shared(train, train)
    assert shares_rows(train, other_cut) and "{count: 9} for evaluation" in why_shared(
        train, other_cut
    )
    assert shares_rows(whole, held)  # a holdout on one side only cuts nothing apart
    assert not shares_rows(whole, RowSide("hub ORG/chat", "test_sft", "", "all"))
    assert not shares_rows(whole, RowSide("hub ORG/other", "train_sft", "", "all"))


def test_the_shipped_chat_sets_evaluate_on_held_out_rows():
    for name in ("ultrachat", "gsm8k", "sharegpt", "instructions", "chat_mix"):
        node = _set(name)
        assert shared_rows(node, "train", node, "test") == [], name
    # the benchmarks validate on sets nothing in chat_mix trains on
    assert shared_rows(_set("chat_mix"), "train", _set("chat_bench"), "test") == []
    # MT-Bench is an evaluation set: every role reads all of it
    mt = _set("mt_bench")
    assert [e.where() for _, e in shared_rows(mt, "train", mt, "test")] == [
        "split 'test' of file local:mt_bench/question.jsonl"
    ]


def test_a_set_read_from_one_split_everywhere_shares_its_rows():
    node = {**_set("ultrachat"), "split": "train_sft"}  # the config as it was
    (pair,) = shared_rows(node, "train", node, "test")
    assert pair[1].where() == "split 'train_sft' of hub HuggingFaceH4/ultrachat_200k"
    mixture = {"source": "mixture", "mixture": [{**node, "label": "u"}, _set("gsm8k")]}
    assert [s.split for s in row_sides(mixture, "test")] == ["train_sft", ""]
