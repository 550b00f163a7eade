"""Export of a drafter with its own tokenizer (distill/export/mapped.py): the folder keeps that
tokenizer, export.json and the card say how to serve it (vLLM TLI, transformers universal
assisted generation), and the self-check passes through `transformers`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.distill.export import stage as export
from tests.distill.mapped_fixtures import build_own_drafter


@pytest.fixture(scope="module")
def own_drafter(tmp_path_factory, toy_tiny) -> Path:
    return build_own_drafter(tmp_path_factory.mktemp("own") / "drafter")


def _cfg(out: Path, drafter: Path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="export",
            overrides=[
                "pair=toy-tiny", f"pair.drafter={drafter}", "pair.min_vocab_coverage=0",
                f"output_dir={out}", "check.max_new_tokens=8", *overrides,
            ],
        )  # fmt: skip


def test_mapped_export_keeps_its_tokenizer_and_says_how_to_serve(tmp_path, own_drafter):
    out = tmp_path / "export"
    res = export.run(_cfg(out, own_drafter))
    own = json.loads((own_drafter / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"] == own
    meta = json.loads((out / "export.json").read_text())
    spec = meta["mapped"]["vllm_speculative_config"]
    assert spec["use_heterogeneous_vocab"] is True and spec["method"] == "draft_model"
    assert spec["model"] == str(out) and meta["mapped"]["intersection"] > 0
    rows = json.loads((own_drafter / "config.json").read_text())["vocab_size"]
    assert meta["vocab_size"] == meta["source_vocab_size"] == rows  # its own rows, none added
    assert "assistant_tokenizer" in res.usage
    card = (out / "README.md").read_text()
    assert '"use_heterogeneous_vocab": True' in card and "assistant_tokenizer=drafter_tok" in card
    serve = shlex.split(res.deployment["vllm_serve"])
    assert json.loads(serve[serve.index("--speculative-config") + 1]) == spec
    assert res.deployment["vllm_serve"] in card
    assert "sglang.launch_server" not in card and "no vocabulary mapping" in card
    check = meta["check"]
    assert check["universal_assisted_equals_target_greedy"].startswith("3 prompts")
    assert 0.0 <= check["tli_greedy_agreement"] <= 1.0 and check["vocab"] == "mapped"
    assert check["our_decoder_tli_equals_target_greedy"] == "3 prompts, gamma 4"


def test_mapped_export_in_vllm_needs_vllm_before_anything_loads(tmp_path, own_drafter, monkeypatch):
    """vllm.enabled=true runs a mapped export in vLLM (TLI; tests/decode/test_validate_vllm_mapped.py
    under -m vllm); without vLLM that is one line naming the extra, before any model loads."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(export, "_load", _refuse_loading)
    with pytest.raises(ConfigError, match=r"^vllm\.enabled=true but vLLM is not installed") as e:
        export.run(_cfg(tmp_path / "export", own_drafter, "vllm.enabled=true"))
    assert "\n" not in str(e.value) and not (tmp_path / "export").exists()


def _refuse_loading(*a, **k):
    raise AssertionError("the drafter was loaded before the error")
