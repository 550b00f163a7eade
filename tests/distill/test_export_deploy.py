"""Every engine's deployment lines from one function (distill/export/deploy.py), and the card's
hub metadata (card.card_metadata): pure, no model loads."""

from __future__ import annotations

import ast
import json
import shlex

import pytest
import yaml

from specdistill.data.models.pairs import PairSpec
from specdistill.decode.validate.vllm_engine import speculative_config
from specdistill.distill.export.card import card_metadata, front_matter
from specdistill.distill.export.deploy import GGUFFiles, deployment

TARGET = "/models/my target/it's big"  # a space and a quote: shlex must quote both
DRAFTER = "/exports/the drafter"


def _argv(line: str) -> list[str]:
    return shlex.split(line)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _python_config(line: str) -> dict:
    """The speculative_config literal of the card's `LLM(...)` statement."""
    call = ast.parse(line).body[0].value  # llm = LLM(model=..., speculative_config={...})
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    assert kwargs["model"] == TARGET
    return kwargs["speculative_config"]


def test_shared_vocab_lines_round_trip_through_shlex_and_the_json_parses():
    d = deployment(TARGET, DRAFTER, 5)
    serve = _argv(d.vllm_serve)
    assert serve[:3] == ["vllm", "serve", TARGET]
    config = json.loads(_flag(serve, "--speculative-config"))
    assert config == {"model": DRAFTER, "method": "draft_model", "num_speculative_tokens": 5}
    assert config == _python_config(d.vllm_python) == d.vllm_speculative_config
    sglang = _argv(d.sglang)
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert _flag(sglang, "--model-path") == TARGET
    assert _flag(sglang, "--speculative-algorithm") == "STANDALONE"
    assert _flag(sglang, "--speculative-draft-model-path") == DRAFTER
    assert _flag(sglang, "--speculative-num-steps") == "5"
    assert _flag(sglang, "--speculative-eagle-topk") == "1"
    assert _flag(sglang, "--speculative-num-draft-tokens") == "6"
    for line in (d.vllm_serve, d.sglang):  # each argument survives a copy and paste
        assert shlex.join(_argv(line)) == line
    # no GGUF exported: no llama-server line, but what to run to make one
    assert d.llama_server is None and d.llama_fetch is None
    assert "gguf.enabled=true" in d.notes["llama_cpp"]
    assert "--spec-draft-n-max 5 --spec-draft-n-min 0" in d.notes["llama_cpp"]
    assert TARGET in d.transformers and DRAFTER in d.transformers


def test_vllm_config_is_validates_own():
    """The card's vLLM settings are the ones validate ran vLLM with (one source)."""
    for drafting, vocab in [("autoregressive", "shared"), ("parallel", "shared"),
                            ("autoregressive", "mapped")]:  # fmt: skip
        d = deployment(TARGET, DRAFTER, 3, drafting=drafting, vocab=vocab)
        pair = PairSpec(TARGET, DRAFTER, TARGET, vocab=vocab)
        expected = speculative_config(pair, 3, parallel=drafting == "parallel")
        assert d.vllm_speculative_config == expected
        assert json.loads(_flag(_argv(d.vllm_serve), "--speculative-config")) == expected
        assert _python_config(d.vllm_python) == expected


def test_parallel_drafter_sets_parallel_drafting_in_both_vllm_forms():
    d = deployment(TARGET, DRAFTER, 4, drafting="parallel")
    config = json.loads(_flag(_argv(d.vllm_serve), "--speculative-config"))
    assert config["parallel_drafting"] is True
    assert _python_config(d.vllm_python)["parallel_drafting"] is True
    assert '"parallel_drafting": True' in d.vllm_python  # Python spells it True, JSON true
    assert '"parallel_drafting": true' in d.vllm_serve
    assert d.sglang is not None and "autoregressively" in d.notes["sglang"]


def test_mapped_drafter_is_tli_in_vllm_and_has_no_sglang_or_llama_cpp_line():
    d = deployment(TARGET, DRAFTER, 4, vocab="mapped")
    config = json.loads(_flag(_argv(d.vllm_serve), "--speculative-config"))
    assert config["use_heterogeneous_vocab"] is True
    assert d.sglang is None and "vocabulary" in d.notes["sglang"]
    assert d.llama_server is None and "no vocabulary mapping" in d.notes["llama_cpp"]
    assert "assistant_tokenizer" in d.transformers


def test_llama_server_line_uses_the_exported_gguf_files():
    gguf = GGUFFiles(target="/gguf files/target Q4.gguf", drafter_file="drafter-f16.gguf")
    d = deployment(TARGET, DRAFTER, 3, gguf=gguf)
    argv = _argv(d.llama_server)
    assert argv == [
        "llama-server", "-m", "/gguf files/target Q4.gguf", "-md", f"{DRAFTER}/drafter-f16.gguf",
        "--spec-type", "draft-simple", "--spec-draft-n-max", "3", "--spec-draft-n-min", "0",
    ]  # fmt: skip
    assert shlex.join(argv) == d.llama_server and d.llama_fetch is None
    assert "llama_cpp" not in d.notes
    # pushed: the drafter's file comes from the hub repo first
    hub = deployment("org/big", "me/drafter", 3, gguf=gguf, drafter_on_hub=True)
    assert _argv(hub.llama_fetch) == [
        "hf", "download", "me/drafter", "drafter-f16.gguf", "--local-dir", "drafter",
    ]  # fmt: skip
    assert _flag(_argv(hub.llama_server), "-md") == "drafter/drafter-f16.gguf"
    assert _flag(_argv(hub.sglang), "--speculative-draft-model-path") == "me/drafter"
    assert _flag(_argv(hub.vllm_serve), "serve") == "org/big"


def test_bad_vocab_kind_or_drafting_is_refused():
    with pytest.raises(ValueError, match="vocab='tli'"):
        deployment(TARGET, DRAFTER, 3, vocab="tli")
    with pytest.raises(ValueError, match="drafting='tree'"):
        deployment(TARGET, DRAFTER, 3, drafting="tree")


def _front_matter(meta: dict) -> dict:
    lines = front_matter(meta)
    assert lines[0] == "---" and lines[2] == "---"
    return yaml.safe_load(lines[1])


def test_front_matter_is_the_hubs_model_card_metadata(tmp_path):
    parsed = _front_matter(
        card_metadata(
            target="org/big", base_drafter="org/small", k=4, vocab="shared", license="apache-2.0"
        )
    )
    assert parsed["base_model"] == "org/small" and parsed["license"] == "apache-2.0"
    assert parsed["pipeline_tag"] == "text-generation"
    assert parsed["library_name"] == "transformers"
    assert {"speculative-decoding", "draft-model"} <= set(parsed["tags"])
    assert parsed["specdistill"] == {"target": "org/big", "num_speculative_tokens": 4,
                                     "vocab": "shared"}  # fmt: skip
    # a local starting checkpoint is no base_model; no license given: none invented
    local = tmp_path / "small"
    local.mkdir()
    plain = _front_matter(
        card_metadata(target=str(tmp_path / "t"), base_drafter=str(local), k=2, vocab="mapped")
    )
    assert "base_model" not in plain and "license" not in plain
    assert plain["specdistill"]["vocab"] == "mapped"
