"""A drafter built from the target's layers: the layers asked for, exactly, as a normal checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.models.drafter_from_target import (
    INFO_FILE,
    ensure_drafter,
    parse_layers,
)
from specdistill.data.runtime import ConfigError, cache_argument
from tests.data.gguf_models import tiny_bpe, tiny_llama


@pytest.mark.parametrize(
    ("choice", "n", "layers"),
    [
        ("first:4", 30, [0, 1, 2, 3]),
        ("spread:4", 30, [0, 10, 19, 29]),
        ("spread:2", 30, [0, 29]),
        ("spread:1", 30, [29]),
        ("spread:30", 30, list(range(30))),
        ("0, 1, 29", 30, [0, 1, 29]),
        ("[2,5]", 30, [2, 5]),
        ([0, 3], 4, [0, 3]),
        (3, 4, [3]),
    ],
)
def test_parse_layers(choice, n, layers):
    assert parse_layers(choice, n) == layers


@pytest.mark.parametrize(
    ("choice", "match"),
    [
        ("first:0", "K must be at least 1"),
        ("spread:31", r"K=31 is more layers than the target has \(30\)"),
        ("first:x", "K in first:K must be a positive integer"),
        ("last:3", "not a layer choice"),
        ("0,30", r"\[30\] out of range; the target has 30 layers \(0..29\)"),
        ([-1, 2], r"\[-1\] out of range"),
        ("2,1", "increasing order"),
        ("1,1", "increasing order"),
        ([], "increasing order"),
    ],
)
def test_parse_layers_rejects(choice, match):
    with pytest.raises(ConfigError, match=r"pair\.drafter_layers=.*" + match):
        parse_layers(choice, 30)


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    tok = tiny_bpe()
    model = tiny_llama(len(tok), layers=6)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def _manual(model, ids, layers):
    """The target run through `layers` only: embeddings -> chosen layers -> final norm -> head."""
    m = model.model
    h = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    pe = m.rotary_emb(h, pos)
    for i in layers:
        out = m.layers[i](h, attention_mask=None, position_embeddings=pe, position_ids=pos)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(m.norm(h))


def test_built_drafter_is_the_chosen_layers(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ensure_drafter(str(target_dir), "spread:3")
    assert out.name == "layers-0-2-5-v1"
    drafter = AutoModelForCausalLM.from_pretrained(out).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    assert drafter.config.num_hidden_layers == 3
    assert [layer.self_attn.layer_idx for layer in drafter.model.layers] == [0, 1, 2]
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight  # tied stays tied
    ids = torch.tensor([[5, 9, 17, 33, 2, 70, 71]])
    with torch.no_grad():
        assert torch.equal(drafter(ids).logits, _manual(target, ids, [0, 2, 5]))
        # and the KV cache works layer by layer (decoding one token after a prefix)
        full = drafter(ids).logits[:, -1]
        name = cache_argument(drafter)  # `cache` since transformers' rename
        past = drafter(ids[:, :-1], use_cache=True)[name]
        step = drafter(ids[:, -1:], use_cache=True, **{name: past}).logits[:, -1]
        assert torch.allclose(full, step, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(target_dir).get_vocab()
    info = json.loads((out / INFO_FILE).read_text())
    assert info["layers"] == [0, 2, 5] and info["target_layers"] == 6 and info["tied_head"]
    assert info["params"] == drafter.num_parameters()


def test_cache_is_keyed_by_the_layer_list(target_dir, monkeypatch):
    import specdistill.data.models.drafter_from_target as mod

    a = ensure_drafter(str(target_dir), "first:2")

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(mod, "build_drafter", no_rebuild)
    assert ensure_drafter(str(target_dir), "0,1") == a  # same layers, same cache entry
    assert ensure_drafter(str(target_dir), [0, 1]) == a
    with pytest.raises(AssertionError, match="rebuilt"):
        ensure_drafter(str(target_dir), "first:3")


def test_cli_prints_path_and_info(target_dir, capsys):
    from specdistill.data.models.drafter_from_target import main

    main(["--target", str(target_dir), "--layers", "first:1"])
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == [0] and info["path"].endswith("layers-0-v1")


def test_disk_full_is_one_line_exit_3_and_no_temp_left(target_dir, capsys, monkeypatch):
    import errno

    import specdistill.data.models.drafter_from_target as mod
    from specdistill.data.models.drafter_from_target import main

    real_build = mod.build_drafter

    def full(target, layers, out, **kw):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mod, "build_drafter", full)
    with pytest.raises(SystemExit) as e:
        main(["--target", str(target_dir), "--layers", "first:2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 3 and len(err) == 1 and err[0].startswith("error: no space left")
    home = mod.specdistill_home() / "drafters"
    assert not [
        p
        for p in home.rglob("*")
        if ".tmp-" in p.name or (p.name.startswith("layers") and not p.name.endswith(".lock"))
    ]
    monkeypatch.setattr(mod, "build_drafter", real_build)
    main(["--target", str(target_dir), "--layers", "first:2"])  # a rerun builds it
    assert json.loads(capsys.readouterr().out)["layers"] == [0, 1]
