"""A drafter with its own tokenizer for the distill and export tests of mapped pairs (TLI): a
1-layer Llama (random init) with a 600-token byte-level BPE trained on toy code at run time."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.data import vocab_fixtures as fx

ROLES = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def build_own_drafter(folder: Path) -> Path:
    """Save the tokenizer and the model into `folder`; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.data.toy.world import toy_prompts

    texts = [r["prompt"] + r.get("completion", "") for r in toy_prompts("toy-tiny", "train")]
    tok = fx.byte_level(texts[:200], 600, ["<|endoftext|>", "<|pad|>"])
    fx.save(tok, folder, **ROLES)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=48,
        intermediate_size=96, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|endoftext|>"), pad_token_id=tok.token_to_id("<|pad|>"),
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
