"""A Llama-architecture `transformers` model written as a GGUF file that llama.cpp serves.

llama.cpp reads drafters as GGUF only, and its own converter (`convert_hf_to_gguf.py`) lives in
its source tree, not in a package. The writing itself is small for the architecture our drafters
have (Llama: SmolLM2, the toy world, `copy:K` drafters of Llama targets), so it is done here
with the `gguf` package (the file format, its quantizers, the tensor names):

- Tensors under llama.cpp's names (`token_embd`, `blk.N.attn_q`, ...). `q_proj` and `k_proj`
  rows are permuted from the Hugging Face rotary layout (two halves of each head) to the
  interleaved pairs llama.cpp's `rope` rotates; `transformers` undoes the same permutation when
  it reads a GGUF file, which is how the round trip is tested.
- Weights in one of `QUANT_TYPES` (f16, q8_0, q4_0, ...) or, tensor role by role, the types of a
  reference GGUF file (the target's own quantisation: SmolLM2's Q4_1 layers and Q8_0
  embeddings). Norms stay F32, as llama.cpp's own files have them; a matrix whose rows do not
  split into the type's blocks falls back to F16.
- The vocabulary: copied field by field from the target's GGUF file when there is one, so the
  drafter's tokens, flags and ids are the target's by construction (llama.cpp's pairing rule,
  `gguf_vocab.py`); otherwise built from a byte-level BPE `tokenizers` tokenizer (the toy
  world's), the one kind whose GGUF form needs no vocabulary-specific code.

Other architectures are refused with the reason; `convert_hf_to_gguf.py` covers them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdistill.data.models.gguf_vocab import gguf_reader
from specdistill.data.runtime import ConfigError

QUANT_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# A tensor role is its llama.cpp name without the block prefix (blk.N.).
NORM_ROLES = ("attn_norm", "ffn_norm", "output_norm")
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass
class GGUFWritten:
    """What was written: the file, its bytes and each tensor's type."""

    path: str
    bytes: int
    file_type: str
    tensor_types: dict[str, str] = field(default_factory=dict)  # role -> type name
    tokenizer_from: str = ""


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]


def file_type_of(types: Mapping[str, str]) -> int:
    """general.file_type: the type most of the weights have (llama.cpp's MOSTLY_* names)."""
    import gguf

    big = Counter(t for role, t in types.items() if role not in NORM_ROLES)
    main = big.most_common(1)[0][0].upper() if big else "F32"
    return int(
        gguf.LlamaFileType.ALL_F32 if main == "F32" else gguf.LlamaFileType[f"MOSTLY_{main}"]
    )


def reference_types(path: str | Path) -> dict[str, str]:
    """Each tensor role's most common type in a GGUF file (its quantisation recipe)."""
    counts: dict[str, Counter] = {}
    for t in gguf_reader(path).tensors:
        role = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        counts.setdefault(role.removesuffix(".weight"), Counter())[t.tensor_type.name] += 1
    types = {role: c.most_common(1)[0][0] for role, c in counts.items()}
    if "output" not in types and "token_embd" in types:  # a tied head: the embeddings' type
        types["output"] = types["token_embd"]
    return types


# `types` naming the target file's own recipe, tensor role by tensor role (`reference_types`)
TARGET_RECIPE = "target"


def types_for(kind: str, target_file: str | Path) -> str | dict[str, str]:
    """What `write_llama_gguf` takes for a requested type: a quantisation name as it is, or
    `target`: the target file's recipe role by role."""
    return reference_types(target_file) if kind == TARGET_RECIPE else kind


def hf_to_rope_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k projection rows from the HF layout (per head: the first halves of the rotary pairs,
    then the second halves) to llama.cpp's (the pairs adjacent)."""
    out, inp = w.shape
    return w.reshape(n_heads, 2, out // n_heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def _kv_heads(config) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    scaling = getattr(config, "rope_scaling", None) or {}
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ConfigError(
            f"export.gguf: rope scaling {rope_type or scaling!r} is not written by specdistill's "
            "GGUF writer; convert the exported checkpoint with llama.cpp's convert_hf_to_gguf.py"
        )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(config, "rope_theta", None) or 10000.0)


def check_architecture(
    model_type: str | None, asked_by: str = "gguf.enabled=true", instead: str = "gguf.enabled=false"
) -> None:
    """The one refusal of an architecture this writer cannot express (the export and validate
    check the drafter's config.json with it before loading; `check_llama` the loaded model).
    `asked_by`: the setting that asked for a GGUF file; `instead`: the one that needs none."""
    if model_type != "llama":
        raise ConfigError(
            f"{asked_by}: the drafter is {model_type!r} and specdistill writes "
            "Llama-architecture GGUF files only; convert the exported folder with llama.cpp's "
            f"convert_hf_to_gguf.py (or set {instead})"
        )


def check_llama(model) -> None:
    """Refuse, in one line, a model this writer cannot express."""
    config = model.config
    check_architecture(getattr(config, "model_type", None))
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError("export.gguf: a Llama with attention or MLP biases is not written")
    _rope_theta(config)


def _tensors(model) -> list[tuple[str, str, np.ndarray]]:
    """(llama.cpp name, role, float32 array) for every weight, q/k permuted."""
    config = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    n_head, n_kv = int(config.num_attention_heads), _kv_heads(config)
    out = [("token_embd.weight", "token_embd", sd["model.embed_tokens.weight"])]
    for i in range(int(config.num_hidden_layers)):
        for hf, role in _LAYER_TENSORS.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if role == "attn_q":
                w = hf_to_rope_interleaved(w, n_head)
            elif role == "attn_k":
                w = hf_to_rope_interleaved(w, n_kv)
            out.append((f"blk.{i}.{role}.weight", role, w))
    out.append(("output_norm.weight", "output_norm", sd["model.norm.weight"]))
    # A tied head has no tensor of its own: llama.cpp then scores with token_embd.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = sd.get("lm_head.weight")
    if head is not None and not (tied and np.array_equal(head, out[0][2])):
        out.append(("output.weight", "output", head))
    return out


def _encode(arr: np.ndarray, type_name: str):
    """(data, raw_dtype or None, type written): 1-D and norms in F32, block types where the
    rows split into blocks, F16 otherwise."""
    import gguf
    from gguf import quants

    t = type_name.upper()
    if arr.ndim == 1 or t == "F32":
        return arr.astype(np.float32), None, "F32"
    if t == "F16":
        return arr.astype(np.float16), None, "F16"
    qtype = _qtype(t)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block:
        return arr.astype(np.float16), None, "F16"
    return quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), qtype, t


def _copy_tokenizer(writer, path: Path) -> None:
    """Every tokenizer.* field of the GGUF file at `path`, with its own value types."""
    import gguf

    for key, f in gguf_reader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, f.contents(), vtype)


def _bpe_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE `tokenizers` tokenizer as llama.cpp's gpt2 vocabulary."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", 1):
        raise ConfigError(
            "export.gguf: the tokenizer is not a plain byte-level BPE (GPT-2 pre-tokenisation) "
            "and the target has no GGUF file to copy the vocabulary from: set "
            "export.gguf.target=PATH.gguf (the target converted by llama.cpp)"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for added in spec.get("added_tokens") or []:
        i = int(added["id"])
        if i < vocab_size:
            tokens[i] = added["content"]
            special = added.get("special", False)
            types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    if bos is not None:
        writer.add_bos_token_id(int(bos))
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(int(tokenizer.pad_token_id))
    if tokenizer.unk_token_id is not None:
        writer.add_unk_token_id(int(tokenizer.unk_token_id))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    writer.add_add_eos_token(bool(getattr(tokenizer, "add_eos_token", False)))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def write_llama_gguf(
    model,
    path: str | Path,
    *,
    types: str | Mapping[str, str] = "f16",
    tokenizer_gguf: str | Path | None = None,
    tokenizer: Any = None,
    name: str = "drafter",
) -> GGUFWritten:
    """Write `model` (a LlamaForCausalLM) to `path` as GGUF; see the module docstring.

    `types`: one of QUANT_TYPES for every matrix, or a role -> type map (`reference_types`).
    The vocabulary comes from `tokenizer_gguf` (copied) or else `tokenizer` (byte-level BPE)."""
    import gguf

    check_llama(model)
    config = model.config
    tensors = _tensors(model)
    rows = tensors[0][2].shape[0]
    if tokenizer_gguf is not None:
        n_tokens = len(gguf_reader(tokenizer_gguf).fields["tokenizer.ggml.tokens"].data)
        if n_tokens != rows:
            raise ConfigError(
                f"export.gguf: the drafter has {rows} embedding rows and the target's GGUF "
                f"{n_tokens} tokens; llama.cpp needs them equal (export pads to the target's "
                "vocab_size: is export.gguf.target the pair's target?)"
            )
    elif tokenizer is None:
        raise ConfigError("export.gguf: no vocabulary source (a target GGUF or a tokenizer)")
    n_head = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // n_head)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    written: dict[str, str] = {}
    encoded = []
    for tname, role, arr in tensors:
        want = types if isinstance(types, str) else types.get(role, "f16")
        data, raw, got = _encode(arr, want)
        written.setdefault(role, got)
        encoded.append((tname, data, raw))
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(_kv_heads(config))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(rows)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    ftype = file_type_of(written)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer_gguf is not None:
        _copy_tokenizer(writer, Path(tokenizer_gguf))
    else:
        _bpe_tokenizer(writer, tokenizer, rows)
    for tname, data, raw in encoded:
        writer.add_tensor(tname, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFWritten(
        path=str(path),
        bytes=path.stat().st_size,
        file_type=gguf.LlamaFileType(ftype).name,
        tensor_types=written,
        tokenizer_from=str(tokenizer_gguf) if tokenizer_gguf else "tokenizer.json",
    )
