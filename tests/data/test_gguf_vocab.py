"""llama.cpp's drafter pairing rule (common_speculative_are_compatible), case by case."""

from __future__ import annotations

import dataclasses

import pytest

from specdistill.data.models.gguf_vocab import (
    CHECK_START_TOKEN_ID,
    MAX_SIZE_DIFFERENCE,
    GGUFVocab,
    compatibility_problems,
)

TOKENS = tuple(f"t{i}" for i in range(300))
BASE = GGUFVocab("gpt2", "smollm", TOKENS, add_bos=False, add_eos=False, bos_id=1, eos_id=2)


def replaced(**changes) -> GGUFVocab:
    return dataclasses.replace(BASE, **changes)


def test_the_same_vocabulary_pairs():
    assert compatibility_problems(BASE, replaced()) == []


@pytest.mark.parametrize(
    "draft, words",
    [
        (replaced(model="llama"), "vocabulary types differ"),
        (replaced(add_bos=True), "adds BOS"),
        (replaced(add_eos=True), "adds EOS"),
        (replaced(tokens=TOKENS[: 300 - MAX_SIZE_DIFFERENCE - 1]), "differ by 129"),
        (replaced(tokens=TOKENS + tuple(f"x{i}" for i in range(129))), "differ by 129"),
        (replaced(tokens=(*TOKENS[:10], "changed", *TOKENS[11:])), "token 10 differs"),
        (replaced(tokens=(*TOKENS[:CHECK_START_TOKEN_ID], "x", *TOKENS[6:])), "token 5"),
        (replaced(add_bos=None, pre="llama3"), "left to llama.cpp's defaults by the drafter"),
    ],
)
def test_what_llama_cpp_refuses(draft, words):
    problems = compatibility_problems(BASE, draft)
    assert problems and words in problems[0], problems


def test_other_bos_refused_only_when_bos_is_added():
    assert compatibility_problems(BASE, replaced(bos_id=7)) == []  # BOS never added: not read
    adds = replaced(add_bos=True)
    problems = compatibility_problems(adds, dataclasses.replace(adds, bos_id=7))
    assert problems == ["BOS ids differ: target 1, drafter 7"]


def test_what_llama_cpp_lets_through():
    """Tokens below id 5 are not compared; 128 tokens of difference in size are allowed; both
    files silent on a flag with the same pre-tokenizer derive the same default."""
    low = replaced(tokens=("a", "b", "c", "d", "e", *TOKENS[5:]))
    assert compatibility_problems(BASE, low) == []
    assert compatibility_problems(BASE, replaced(tokens=TOKENS[: 300 - MAX_SIZE_DIFFERENCE])) == []
    silent = replaced(add_bos=None, add_eos=None)
    assert compatibility_problems(silent, dataclasses.replace(silent)) == []
