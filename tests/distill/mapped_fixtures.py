"""A drafter with its own tokenizer for the distill, export and vLLM tests of mapped pairs (TLI):
a 600-token byte-level BPE trained on toy code at run time, under a 1-layer random Llama or,
given a target, under the target's own weights moved into the drafter's ids."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.data import vocab_fixtures as fx

ROLES = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def build_own_drafter(folder: Path, target: Path | None = None) -> Path:
    """Save the tokenizer and the model into `folder`; returns it.

    `target` (a Llama folder with its tokenizer): the drafter takes the target's architecture and
    weights, its embedding and head rows moved to its own ids through the tokens both tokenizers
    spell the same (the rest keep random rows). It then agrees with the target wherever the
    context it reads and p's argmax are in the intersection, so its TLI acceptance is neither 0
    nor 1, and its head size is the target's (vLLM's CPU attention refuses the default's 24)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.data.toy.world import toy_prompts

    texts = [r["prompt"] + r.get("completion", "") for r in toy_prompts("toy-tiny", "train")]
    tok = fx.byte_level(texts[:200], 600, ["<|endoftext|>", "<|pad|>"])
    fx.save(tok, folder, **ROLES)
    ids = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token_id": tok.token_to_id("<|endoftext|>"),
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "bos_token_id": None,
    }
    torch.manual_seed(0)
    if target is None:
        config = LlamaConfig(
            hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, **ids,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(folder)
        return folder
    from specdistill.data.models.vocab_mapping import read_source, vocab_mapping

    source = LlamaForCausalLM.from_pretrained(str(target))
    config = copy.deepcopy(source.config)
    for key, value in ids.items():
        setattr(config, key, value)
    model = LlamaForCausalLM(config)
    d2t = vocab_mapping(read_source(target), read_source(folder)).draft_to_target
    rows, state = d2t >= 0, model.state_dict()
    for key, value in source.state_dict().items():
        if key in VOCAB_ROWS:
            state[key][rows] = value[d2t[rows]]
        else:
            state[key] = value
    model.load_state_dict(state)
    model.save_pretrained(folder)
    return folder
