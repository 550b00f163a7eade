"""Telling `transformers`' own failures in universal assisted generation from ours.

Two tokenizers built here (a BPE over a little prose, and its bytes alone, so the drafter spells
the same text in more tokens, as the toy tokenizer does against SmolLM2's) under tiny random
Llamas: the export's check reproduces the target's greedy output on any release, records a
failure raised inside transformers' candidate generator as the release's fault, and lets every
other failure through.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.universal_assisted import KNOWN_GOOD, upstream_fault

TEXT = ["The quick brown fox jumps over the lazy dog. " * 20, "Hello world, drafts. " * 20]


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def _llama(vocab: int, seed: int, head_scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # confident: it drafts past one token a round
    return model


@pytest.fixture(scope="module")
def pair():
    target_tok, draft_tok = _tokenizer(400), _tokenizer(257)
    return target_tok, draft_tok, _llama(len(target_tok), 0), _llama(len(draft_tok), 1, 100.0)


def test_the_export_check_gives_the_targets_output_and_names_a_fault(pair):
    from specdistill.distill.export.check import greedy
    from specdistill.distill.export.mapped import universal_equals_greedy, universal_finding

    target_tok, draft_tok, target, drafter = pair
    device = torch.device("cpu")
    text = "The quick brown fox"
    ids, plain, fault = universal_equals_greedy(
        target, drafter, target_tok, draft_tok, text, 40, device, None
    )
    assert plain == greedy(target, ids, 40, target_tok.pad_token_id)
    finding = universal_finding(fault, 1, len(plain))
    if fault is None:
        assert finding == {
            "universal_assisted_equals_target_greedy": f"1 prompts, {len(plain)} tokens"
        }
    else:  # the installed release breaks inside its candidate generator (pyproject excludes it)
        assert fault.where.startswith("candidate_generator.py") and fault.version != KNOWN_GOOD
        assert finding["universal_assisted_fault"] == fault.line()
    # once it has failed, later prompts take the target's own output without calling it again
    marker = fault or upstream_fault(_raised_inside_the_candidate_generator(pair))
    _, again, kept = universal_equals_greedy(
        target, drafter, target_tok, draft_tok, text, 40, device, marker
    )
    assert again == plain and kept is marker


def _raised_inside_the_candidate_generator(pair) -> RuntimeError:
    """A RuntimeError from the drafter's forward, which transformers' candidate generator calls."""
    target_tok, draft_tok, target, drafter = pair
    ids = target_tok("The quick brown fox", return_tensors="pt").input_ids

    def broken(*args, **kwargs):
        raise RuntimeError("drafter forward failed")

    drafter.forward, original = broken, drafter.forward
    try:
        target.generate(
            ids, assistant_model=drafter, tokenizer=target_tok, assistant_tokenizer=draft_tok,
            do_sample=False, max_new_tokens=4, pad_token_id=target_tok.pad_token_id,
        )  # fmt: skip
    except RuntimeError as e:
        return e
    finally:
        drafter.forward = original
    raise AssertionError("the broken drafter did not fail")


def test_only_failures_inside_the_candidate_generator_are_transformers_own(pair):
    fault = upstream_fault(_raised_inside_the_candidate_generator(pair))
    assert fault is not None and fault.where.startswith("candidate_generator.py")
    assert fault.message == "drafter forward failed"
    line = fault.line()
    assert "\n" not in line and f"pip install 'transformers=={KNOWN_GOOD}'" in line
    try:
        raise RuntimeError("ours")
    except RuntimeError as e:
        assert upstream_fault(e) is None  # raised here, not under transformers' generator
    assert upstream_fault(KeyError("x")) is None


def test_any_other_failure_of_the_export_check_propagates(pair, monkeypatch):
    from specdistill.distill.export import mapped

    target_tok, draft_tok, target, drafter = pair

    def broken(*args, **kwargs):
        raise RuntimeError("not transformers'")

    monkeypatch.setattr(mapped, "assisted_equals_greedy", broken)
    with pytest.raises(RuntimeError, match="not transformers'"):
        mapped.universal_equals_greedy(
            target, drafter, target_tok, draft_tok, "The quick", 8, torch.device("cpu"), None
        )
