"""Tiny GGUF files for the converter's tests: a random Llama and a byte-level BPE tokenizer,
written with `gguf.GGUFWriter` the way llama.cpp's convert_hf_to_gguf.py lays them out (Q/K rows
permuted, tied head left out), in well under a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(path: Path, model, tokenizer, *, quant: str = "F32") -> Path:
    """Write `model` (a LlamaForCausalLM) and `tokenizer` as a GGUF file; quant F32 or Q8_0."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0 if quant == "F32" else 7)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    import json

    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_unk_token_id(tokenizer.unk_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    qtype = gguf.GGMLQuantizationType[quant]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def add(name: str, arr: np.ndarray, quantize: bool = True) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quantize and qtype != gguf.GGMLQuantizationType.F32 and arr.ndim == 2:
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"], quantize=False)
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], quantize=False)
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], quantize=False)
        q = _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
