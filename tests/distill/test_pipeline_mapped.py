"""The pipeline on a mapped pair (a drafter with its own tokenizer): every stage runs
it end to end on toy-tiny, and what a mapped pair cannot run is one `error:` line from the plan,
before generate spends its minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdistill.data.io import read_json
from specdistill.data.models.pair_vocab import resolves_to_mapped
from specdistill.data.runtime import ConfigError
from specdistill.distill.pipeline import stage as pipeline
from specdistill.distill.pipeline.plan import build_plan
from tests.distill.mapped_fixtures import build_own_drafter
from tests.distill.test_pipeline import _cfg


@pytest.fixture(scope="module")
def own_drafter(tmp_path_factory, toy_tiny) -> Path:
    return build_own_drafter(tmp_path_factory.mktemp("own") / "drafter")


def test_which_pairs_the_plan_knows_are_mapped(toy_tiny, own_drafter):
    target = {"target": str(toy_tiny.target_dir)}
    assert resolves_to_mapped({"toy": "toy-tiny", "vocab": "mapped"})
    assert resolves_to_mapped(target | {"drafter": str(own_drafter)})  # auto, two local folders
    assert not resolves_to_mapped(target | {"drafter": str(own_drafter), "vocab": "shared"})
    assert not resolves_to_mapped(target | {"drafter": str(toy_tiny.drafter_dir)})  # same tok
    assert not resolves_to_mapped({"toy": "toy-tiny"})  # no drafter named: the stages resolve it


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["stages=[generate,distill,online,validate,export]"], "stages include online"),
        (["serving=sampling"], r"lmbda=1\.0: on-policy batches are not supported"),
        (["drafting=parallel"], "drafting=parallel: a drafter with its own tokenizer"),
    ],
)
def test_what_a_mapped_pair_cannot_run_is_refused_by_the_plan(
    tmp_path, own_drafter, extra, message
):
    cfg = _cfg(tmp_path / "run", [f"pair.drafter={own_drafter}", *extra])
    with pytest.raises(ConfigError, match=message):
        build_plan(cfg)
    assert not (tmp_path / "run" / "generate").exists()


def test_vllm_true_plans_the_mapped_export_in_vllm(tmp_path, own_drafter, engines_installed):
    """vllm=true is no longer refused for a mapped pair: the export validates in vLLM (TLI)."""
    cfg = _cfg(tmp_path / "run", [f"pair.drafter={own_drafter}", "vllm=true"])
    steps = {s.name: s for s in build_plan(cfg)}
    assert steps["export"].config["vllm"]["enabled"] is True


def test_the_pipeline_runs_a_mapped_pair_end_to_end(tmp_path, own_drafter):
    """generate -> distill (TLI rows) -> validate (base and distilled, mapped drafter) -> export
    (the drafter keeps its own tokenizer, served with use_heterogeneous_vocab)."""
    run_dir = tmp_path / "run"
    result = pipeline.run(_cfg(run_dir, [f"pair.drafter={own_drafter}"]))
    assert set(result.stages) == {"generate", "distill", "validate_base", "validate", "export"}
    assert result.stages["distill"]["data"]["vocab"] == "mapped"
    for name in ("validate_base", "validate"):
        report = read_json(run_dir / name / "report.json")
        assert report["lossless"] is True, name
        assert report["vocab_mapping"]["intersection"] > 0, name
    exported = run_dir / "export" / "drafter"
    export = read_json(exported / "export.json")
    assert export["mapped"]["vocab"] == "mapped"
    own = (own_drafter / "tokenizer.json").read_text()
    assert (exported / "tokenizer.json").read_text() == own  # its own tokenizer, not the target's
