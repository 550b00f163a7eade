"""Tiny GGUF files for the converter's tests: a random Llama and a byte-level BPE tokenizer,
written by specdistill's GGUF writer (llama.cpp's layout: Q/K rows permuted, tied head left
out), in well under a second."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_bpe(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few lines, SmolLM2-style special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."]
    tok.train_from_iterator(text * 50, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_llama(vocab: int, layers: int = 4, hidden: int = 32, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def write_llama_gguf(path: Path, model, tokenizer, *, quant: str = "F32") -> Path:
    """Write `model` (a LlamaForCausalLM) and `tokenizer` as a GGUF file (quant F32 or Q8_0)
    with the product's writer (data/models/gguf_writer.py), whose round trip test_gguf_writer.py
    checks."""
    from specdistill.data.models.gguf_writer import write_llama_gguf as write

    write(model, path, types=quant.lower(), tokenizer=tokenizer, name="tiny-llama")
    return Path(path)
