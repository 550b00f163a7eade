"""Tiny random-weight stand-ins for the cluster presets' hub models and for UltraChat, written at
run time as local folders laid out as the hub's, for the dress rehearsal (test_rehearsal.py).

What is kept from the real models is what the pipeline's code paths depend on: the architecture
class; the vocabulary size, which switches the draft vocabulary on (`draft_vocab: auto` from 16k
rows; `draft_vocab_train: auto` from 131072 rows: on for Qwen3's 151936, off for Llama 3's
128256); the special tokens and their roles (Llama 3 adds `<|begin_of_text|>` and has no pad
token; Qwen3 has no bos token, pads with `<|endoftext|>` and its head has rows past the
tokenizer, which a trained model never predicts); the chat template's behaviour (Llama 3's
headers; Qwen3's `enable_thinking` switch and its reasoning block dropped from earlier answers);
tied or untied heads, RoPE settings, bf16 weights and the sampling defaults of
`generation_config.json`. Widths and depths are tiny. The tokenizer is a byte-level BPE whose
merges are generated (every pair, then every triple, of a small alphabet) up to the real
vocabulary size, so a random model's tokens decode to text and re-encode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

# Meta-Llama-3-Instruct's template (every message as a header block; bos first).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Qwen3's behaviour: ChatML turns; an earlier answer loses its reasoning block (the text up to
# `</think>`); the reply's header, followed by an empty reasoning block when
# enable_thinking=false (the model then answers directly).
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

LLAMA3_SPECIAL = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}
QWEN3_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
# Qwen3's added tokens that are not special: they survive decoding (the reasoning block's tags).
QWEN3_ADDED = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]  # fmt: skip

SENTENCES = [
    "How do I keep a sourdough starter alive while travelling?",
    "Write a short poem about the sea at night.",
    "Explain the difference between a list and a tuple in Python.",
    "What are three ways to save energy at home?",
    "Summarise the plot of a detective story in two sentences.",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue during the day and red at sunset?",
    "Suggest a name for a small bakery by the river.",
    "How does a bicycle stay upright when it moves?",
    "List some tips for learning to play the guitar.",
    "What should I pack for a weekend of hiking?",
    "Describe a calm morning in a mountain village.",
    "How can a team run better meetings?",
    "Translate 'good morning, friends' into French and Spanish.",
    "What is a prime number, with an example?",
    "Plan a reading list for someone new to science fiction.",
]
FOLLOW_UPS = ["Can you make it shorter?", "Now explain it to a child.", "Add one more example."]


@dataclass(frozen=True)
class HubPair:
    """A preset's pair as local model folders (what `pair.target` / `pair.drafter` name)."""

    target: Path
    drafter: Path


def _merges_alphabet() -> list[str]:
    """The byte-level characters the generated merges combine: letters, digits, space (Ġ)."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return ["Ġ", *letters, "Ċ"]


def byte_bpe(size: int) -> Tokenizer:
    """A byte-level BPE of exactly `size` tokens: the 256 byte characters, then generated merges
    (every pair of the alphabet, then every pair with a third character) in that rank order."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    chars = _merges_alphabet()
    level = [a + b for a, b in product(chars, chars)]
    for a, b in product(chars, chars):
        if len(vocab) == size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for ab, c in product(level, chars):
        if len(vocab) == size:
            break
        vocab[ab + c] = len(vocab)
        merges.append((ab, c))
    if len(vocab) != size:
        raise ValueError(f"the generated merges reach {len(vocab)} tokens, not {size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _save_tokenizer(
    tok: Tokenizer, folders: list[Path], template: str, **roles: str | None
) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
    fast.chat_template = template
    for folder in folders:
        fast.save_pretrained(folder)


def llama3_tokenizer(folders: list[Path]) -> None:
    """Llama 3's layout: 128000 BPE tokens, then 256 special ones (the named ones at their ids,
    the rest reserved); `<|begin_of_text|>` added in front of every encoding; no pad token."""
    tok = byte_bpe(128000)
    specials = [LLAMA3_SPECIAL.get(i, f"<|reserved_special_token_{i - 128000}|>")
                for i in range(128000, 128256)]  # fmt: skip
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 128000)],
    )
    _save_tokenizer(tok, folders, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                    eos_token="<|eot_id|>")  # fmt: skip


def qwen3_tokenizer(folders: list[Path]) -> None:
    """Qwen3's layout: 151643 BPE tokens, its special tokens from 151643, the reasoning tags as
    added non-special tokens (151669 in all; the model's 151936 rows pad past them); no bos."""
    tok = byte_bpe(151643)
    tok.add_special_tokens(QWEN3_SPECIAL)
    tok.add_tokens(QWEN3_ADDED)
    _save_tokenizer(tok, folders, QWEN3_TEMPLATE, eos_token="<|im_end|>",
                    pad_token="<|endoftext|>")  # fmt: skip


def _save_model(model, folder: Path, generation: dict) -> None:
    """bf16 weights as the hub ships them, and its generation config (sampling defaults)."""
    model.to(torch.bfloat16).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _llama(tie: bool, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], tie_word_embeddings=tie,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _qwen3(tie: bool, layers: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=tie, initializer_range=0.2,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def llama3_pair(root: Path) -> HubPair:
    """Llama-3.1-8B-Instruct <- Llama-3.2-1B-Instruct in miniature (untied target, tied drafter)."""
    gen = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True,
           "temperature": 0.6, "top_p": 0.9}  # fmt: skip
    pair = HubPair(root / "Llama-3.1-8B-Instruct", root / "Llama-3.2-1B-Instruct")
    for folder, model in ((pair.target, _llama(False, 2, 0)), (pair.drafter, _llama(True, 1, 1))):
        _save_model(model, folder, gen)
    llama3_tokenizer([pair.target, pair.drafter])
    return pair


def _untrained_rows(model, first: int):
    """Head and embedding rows from `first` on set to zero: the rows past the tokenizer, which
    a trained model never predicts (a random one would, as often as any other)."""
    with torch.no_grad():
        model.get_output_embeddings().weight[first:] = 0
        model.get_input_embeddings().weight[first:] = 0
    return model


def qwen3_pair(root: Path) -> HubPair:
    """Qwen3-8B <- Qwen3-0.6B in miniature (untied target, tied drafter)."""
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
           "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}  # fmt: skip
    pair = HubPair(root / "Qwen3-8B", root / "Qwen3-0.6B")
    size = 151643 + len(QWEN3_SPECIAL) + len(QWEN3_ADDED)  # the tokenizer's 151669
    target, drafter = (_untrained_rows(_qwen3(tie, n, seed), size)
                       for tie, n, seed in ((False, 2, 0), (True, 1, 1)))  # fmt: skip
    for folder, model in ((pair.target, target), (pair.drafter, drafter)):
        _save_model(model, folder, gen)
    qwen3_tokenizer([pair.target, pair.drafter])
    return pair


PAIRS = {"llama3": llama3_pair, "qwen3": qwen3_pair}


def conversation(k: int, split: str) -> dict:
    """UltraChat's row: prompt, prompt_id and OpenAI messages (two turns for every other row)."""
    first = f"{SENTENCES[k % len(SENTENCES)]} ({split} {k})"
    messages = [{"role": "user", "content": first},
                {"role": "assistant", "content": f"A reference answer to {split} {k}."}]  # fmt: skip
    if k % 2:
        messages += [{"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]},
                     {"role": "assistant", "content": "A shorter one."}]  # fmt: skip
    return {"prompt": first, "prompt_id": f"{split}-{k}", "messages": messages}


def ultrachat_folder(root: Path, train: int = 12, test: int = 6) -> Path:
    """A local dataset folder laid out as HuggingFaceH4/ultrachat_200k on the hub: parquet files
    under data/ and the README's `configs` naming the splits train_sft and test_sft, which
    `datasets.load_dataset(FOLDER, split=...)` reads as it reads the hub repository."""
    import datasets

    folder = root / "ultrachat_200k"
    (folder / "data").mkdir(parents=True)
    for split, n in (("train_sft", train), ("test_sft", test)):
        rows = [conversation(k, split) for k in range(n)]
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / f"{split}.parquet"))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train_sft\n    path: data/train_sft.parquet\n"
        "  - split: test_sft\n    path: data/test_sft.parquet\n---\n"
    )
    return folder
