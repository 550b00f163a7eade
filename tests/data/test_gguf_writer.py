"""specdistill's GGUF writer: llama.cpp's layout, read back by `transformers` to the same logits
and tokens, the vocabulary copied exactly from a target file, quantisation recipes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdistill.data.models.gguf_vocab import compatibility_problems, read_gguf_vocab
from specdistill.data.models.gguf_writer import (
    hf_to_rope_interleaved,
    reference_types,
    write_llama_gguf,
)
from specdistill.data.runtime import ConfigError
from tests.data.gguf_models import tiny_bpe, tiny_llama

TEXT = "def add(a, b):\n    return a + b\nThe quick brown fox"


@pytest.fixture(scope="module")
def tok():
    return tiny_bpe()


def test_rope_permutation_against_brute_force():
    """HF keeps each head's rotary pairs (i, i + d/2); llama.cpp wants them adjacent (2i, 2i+1)."""
    heads, d, cols = 3, 8, 5
    w = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    out = hf_to_rope_interleaved(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            for j in range(2):
                np.testing.assert_array_equal(out[h * d + 2 * i + j], w[h * d + j * (d // 2) + i])


def _read_back(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize(
    "types, tied, tol, agree",
    [("f16", True, 2e-2, 1.0), ("q8_0", False, 0.25, 0.8), ("f32", False, 1e-5, 1.0)],
)
def test_round_trip_through_transformers(tmp_path, tok, types, tied, tol, agree):
    """`agree`: the share of positions whose argmax survives (a random model has near ties)."""
    import gguf

    model = tiny_llama(len(tok), layers=2, hidden=64, heads=4, kv_heads=2)
    with torch.no_grad():  # peaked attention, so rotary pairs in the wrong order show at f16
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    path = tmp_path / f"m-{types}.gguf"
    written = write_llama_gguf(model, path, types=types, tokenizer=tok)
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("output.weight" in names) is (not tied)  # a tied head has no tensor of its own
    assert names["blk.1.attn_norm.weight"] == "F32"
    assert names["blk.0.attn_q.weight"] == types.upper() == written.tensor_types["attn_q"]
    back, back_tok = _read_back(path)
    ids = tok(TEXT).input_ids
    assert back_tok(TEXT).input_ids == ids
    with torch.no_grad():
        a, b = model(torch.tensor([ids])).logits, back(torch.tensor([ids])).logits
    assert (a - b).abs().max().item() < tol
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= agree


def test_vocabulary_copied_from_the_target_file(tmp_path, tok):
    target = tiny_llama(len(tok), layers=2)
    target_file = write_llama_gguf(target, tmp_path / "target.gguf", types="f16", tokenizer=tok)
    drafter = tiny_llama(len(tok), layers=1)
    out = write_llama_gguf(
        drafter, tmp_path / "drafter.gguf", types="q8_0", tokenizer_gguf=target_file.path
    )
    t, d = read_gguf_vocab(target_file.path), read_gguf_vocab(out.path)
    assert d == t and compatibility_problems(t, d) == []
    assert out.tokenizer_from == target_file.path
    with pytest.raises(ConfigError, match="embedding rows"):  # rows must equal the tokens
        write_llama_gguf(
            tiny_llama(len(tok) + 3, layers=1), tmp_path / "x.gguf", tokenizer_gguf=target_file.path
        )


def test_recipe_of_a_reference_file(tmp_path, tok):
    model = tiny_llama(len(tok), layers=2, hidden=64)
    recipe = {"token_embd": "q8_0", "attn_q": "q4_1", "attn_k": "q4_1", "ffn_down": "q5_0"}
    ref = write_llama_gguf(model, tmp_path / "ref.gguf", types=recipe, tokenizer=tok)
    types = reference_types(ref.path)
    assert types["token_embd"] == "Q8_0" and types["attn_q"] == "Q4_1"
    assert types["ffn_down"] == "Q5_0" and types["attn_v"] == "F16"  # unnamed roles: f16
    assert types["output"] == "Q8_0"  # tied: the head is the embeddings
    assert ref.file_type == "MOSTLY_F16"  # most matrices of this recipe are f16


def test_rows_that_do_not_split_into_blocks_stay_f16(tmp_path, tok):
    model = tiny_llama(len(tok), layers=1, hidden=48, heads=4, kv_heads=2)  # 48 % 32 != 0
    written = write_llama_gguf(model, tmp_path / "m.gguf", types="q8_0", tokenizer=tok)
    assert written.tensor_types["attn_q"] == "F16"
    assert written.tensor_types["ffn_down"] == "Q8_0"  # its rows are 96 long


def test_other_architectures_refused(tmp_path, tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok)))
    with pytest.raises(ConfigError, match="Llama-architecture GGUF files only"):
        write_llama_gguf(model, tmp_path / "g.gguf", tokenizer=tok)
