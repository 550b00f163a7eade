"""Pair resolution and vocabulary checks fail early, naming the field and the fix."""

from __future__ import annotations

import pytest
import torch

from specdistill.data.models.pairs import (
    check_same_tokenizer,
    check_vocab,
    match_vocab,
    resolve_pair,
)
from specdistill.data.runtime import ConfigError, parse_dtype


def test_check_vocab_accepts_padding_only():
    assert check_vocab(target_vocab=128, drafter_vocab=100, tokenizer_len=100) == 128
    assert check_vocab(target_vocab=100, drafter_vocab=128, tokenizer_len=100) == 100


def test_check_vocab_rejects_real_mismatch():
    with pytest.raises(ConfigError, match="vocab sizes differ"):
        check_vocab(target_vocab=128, drafter_vocab=90, tokenizer_len=100)
    with pytest.raises(ConfigError, match="pair.tokenizer"):
        check_vocab(target_vocab=90, drafter_vocab=128, tokenizer_len=100)


def test_match_vocab_pads_with_neg_inf_and_trims():
    x = torch.randn(2, 3, 5)
    padded = match_vocab(x, 8)
    assert padded.shape == (2, 3, 8)
    assert torch.equal(padded[..., :5], x)
    assert torch.isinf(padded[..., 5:]).all() and (padded[..., 5:] < 0).all()
    assert torch.softmax(padded, -1)[..., 5:].sum() == 0
    assert torch.equal(match_vocab(x, 4), x[..., :4])
    assert match_vocab(x, 5) is x


def test_resolve_pair_toy_fills_paths(toy_tiny):
    spec = resolve_pair({"toy": "toy-tiny"})
    assert spec.target == str(toy_tiny.target_dir)
    assert spec.drafter == str(toy_tiny.drafter_dir)
    assert spec.tokenizer == spec.target


def test_resolve_pair_missing_paths_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="pair.target"):
        resolve_pair({"toy": None, "target": None, "drafter": "x"})
    with pytest.raises(ConfigError, match=r"pair.drafter=.*does not exist"):
        resolve_pair({"target": "org/model", "drafter": str(tmp_path / "nope")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_pair({"target": str(tmp_path / "empty"), "drafter": "org/model"})
    with pytest.raises(ConfigError, match="pair.toy"):
        resolve_pair({"toy": "huge"})


def test_different_tokenizers_are_rejected(toy_tiny):
    from transformers import AutoTokenizer

    from specdistill.data.toy.world import train_tokenizer

    tok = AutoTokenizer.from_pretrained(toy_tiny.target_dir)
    other = train_tokenizer(["completely different text " * 50, "zzz yyy xxx " * 50], 300)
    check_same_tokenizer(tok, tok)
    with pytest.raises(ConfigError, match="different tokenizer"):
        check_same_tokenizer(tok, other)


def test_parse_dtype():
    assert parse_dtype("auto", "cpu") == torch.float32
    assert parse_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        parse_dtype("fp8", "cpu")
