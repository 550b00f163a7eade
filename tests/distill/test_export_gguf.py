"""`export gguf.enabled=true`: the drafter as GGUF files llama.cpp pairs with the target."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from specdistill.data.models.gguf_vocab import compatibility_problems, read_gguf_vocab
from specdistill.data.runtime import ConfigError
from specdistill.distill.export import stage as export
from specdistill.distill.export.gguf_files import GGUFSettings, check_gguf_export
from tests.conftest import stage_node
from tests.distill.test_export import _cfg

PROMPT = "def add(a, b):\n    return"


def test_gguf_files_pass_llama_cpps_rule_and_keep_the_logits(tmp_path, toy_tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "drafter"
    result = export.run(_cfg(out, "gguf.enabled=true", "gguf.types=[f16,q8_0,target]"))
    record = json.loads((out / "export.json").read_text())["gguf"]
    assert record == result.gguf and record["compatible"] is True
    assert set(record["files"]) == {"f16", "q8_0", "target"}
    target_file = record["target"]  # the toy target written once as f16 GGUF
    assert target_file.endswith(".gguf") and "gguf_written" in target_file
    target_vocab = read_gguf_vocab(target_file)
    for _kind, f in record["files"].items():
        assert (out / f["file"]).is_file()
        assert compatibility_problems(target_vocab, read_gguf_vocab(out / f["file"])) == []
    assert record["files"]["q8_0"]["tensor_types"]["attn_q"] == "Q8_0"
    assert record["files"]["target"]["file_type"] == "MOSTLY_F16"  # the toy target's recipe
    card = (out / "README.md").read_text()
    assert "## llama.cpp" in card and f"-m {target_file} -md {out}/drafter-f16.gguf" in card
    assert f"--spec-draft-n-max {record['k']}" in card
    # the card's llama-server line is the deployment's, with the files export wrote
    argv = shlex.split(record["llama_server"])
    assert argv[argv.index("-md") + 1] == f"{out}/drafter-f16.gguf"
    assert argv[argv.index("-m") + 1] == target_file and record["llama_server"] in card
    assert result.deployment["llama_server"] == record["llama_server"]
    # The f16 file is the exported checkpoint: transformers reads it back to the same logits.
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok(PROMPT).input_ids])
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file="drafter-f16.gguf").eval()
    with torch.no_grad():
        a, b = exported(ids).logits, back(ids).logits
    assert (a - b).abs().max().item() < 2e-2 and torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["gguf.types=[f16,q3_k]"], "gguf.types=['f16', 'q3_k']: ['q3_k'] unknown"),
        (["gguf.types=[]"], "gguf.types=[]: empty"),
        (["gguf.target=/nonexistent/t.gguf"], "gguf.target='/nonexistent/t.gguf' does not exist"),
        (["gguf.enabled=yes"], "gguf.enabled='yes' must be true or false"),
    ],
)
def test_bad_gguf_settings_fail_before_loading(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        export.run(_cfg(tmp_path / "d", "gguf.enabled=true", *overrides))
    assert not (tmp_path / "d").exists()


def test_mapped_and_non_llama_drafters_are_refused_up_front():
    on = GGUFSettings.from_node(stage_node("export", "gguf", enabled=True))
    with pytest.raises(ConfigError, match="llama.cpp has no vocabulary mapping"):
        check_gguf_export(on, "mapped", {"model_type": "llama"})
    with pytest.raises(ConfigError, match="the drafter is 'qwen2'"):
        check_gguf_export(on, "shared", {"model_type": "qwen2"})
    check_gguf_export(on, "shared", {})  # a hub id: checked when its weights load
    check_gguf_export(
        GGUFSettings.from_node(stage_node("export", "gguf")), "mapped", {"model_type": "qwen2"}
    )  # not asked: no check


@pytest.mark.llamacpp
def test_llama_server_serves_the_exported_drafter_and_refuses_a_changed_vocabulary(
    tmp_path, toy_tiny
):
    """The toy pair end to end in llama.cpp: the exported q8_0 drafter drafts for the toy target
    (written as GGUF) with greedy output identical to plain; a drafter whose token 10 was
    renamed is refused by our check and by llama-server alike (which then serves the target
    without it)."""
    import gguf
    from transformers import AutoTokenizer

    from specdistill.decode.llamacpp import build
    from specdistill.decode.llamacpp.measure import engine_figures
    from specdistill.decode.llamacpp.server import LlamaServer

    try:
        binary = build.llama_server_binary()
    except ConfigError as e:
        pytest.skip(f"no llama-server binary: {e}")
    out = tmp_path / "drafter"
    record = export.run(_cfg(out, "gguf.enabled=true", "gguf.types=[q8_0]")).gguf
    target, drafter = record["target"], out / "drafter-q8_0.gguf"
    tok = AutoTokenizer.from_pretrained(out)
    prompts = [tok(p).input_ids for p in (PROMPT, "class Stack:\n    def push(self, x):\n")]
    runs = []
    for draft in (None, drafter):
        with LlamaServer(binary, target, draft=draft, draft_max=3, threads=1, ctx=512) as s:
            runs.append([s.complete(ids, 24, ignore_eos=True) for ids in prompts])
    fig = engine_figures(*runs)
    assert fig.greedy_identical and fig.drafted > 0, fig

    # token 10 renamed in an otherwise identical file
    reader = gguf.GGUFReader(str(drafter))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    tokens[10] = tokens[10] + "_renamed"
    bad = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(bad), "llama")
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = tokens if key == "tokenizer.ggml.tokens" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, f.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # bytes as they were
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    problems = compatibility_problems(read_gguf_vocab(target), read_gguf_vocab(bad))
    assert problems and problems[0].startswith("token 10 differs")
    # llama-server logs the refusal and serves the target without the drafter
    log = tmp_path / "bad.log"
    with LlamaServer(binary, target, draft=bad, draft_max=3, threads=1, ctx=512, log_path=log) as s:
        assert s.complete(prompts[0], 8, ignore_eos=True).draft_n == 0
    assert "the target and draft vocabs are not compatible" in log.read_text()
