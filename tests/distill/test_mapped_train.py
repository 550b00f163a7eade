"""The distill stage on a drafter with its own tokenizer (TLI, distill/train/mapped.py): Seq-KD
rows mapped into the drafter's ids, and a tiny end-to-end run on toy-tiny whose held-out TLI
acceptance rises. The drafter and its tokenizer are built at run time (tests/data/vocab_fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdistill.data.models import vocab_mapping as vm
from specdistill.data.runtime import ConfigError
from specdistill.distill.intersection import Intersection
from specdistill.distill.train import mapped, sources
from specdistill.distill.train import stage as train
from specdistill.distill.train.data import Example
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import SharedVocab
from tests.distill.mapped_fixtures import build_own_drafter


@pytest.fixture(scope="module")
def own_drafter(tmp_path_factory, toy_tiny) -> Path:
    return build_own_drafter(tmp_path_factory.mktemp("own") / "drafter")


def _mapping(toy_tiny, drafter: Path) -> vm.VocabMapping:
    t = vm.read_source(toy_tiny.tokenizer_dir, "toy-tiny")
    return vm.vocab_mapping(t, vm.read_source(drafter, "own"))


def test_seqkd_rows_are_mapped_as_tli_reads_them(toy_tiny, own_drafter):
    """A target token outside the intersection becomes the drafter's unk (here its eos: the
    tokenizer has no unk, vLLM's fallback); the top-k ids become the drafter rows proposing them."""
    from transformers import AutoTokenizer

    m = _mapping(toy_tiny, own_drafter)
    dtok = AutoTokenizer.from_pretrained(own_drafter)
    unk = mapped.draft_unk_id(dtok)
    assert unk == dtok.eos_token_id
    inter = Intersection.from_draft_to_target(m.draft_to_target, m.target_vocab)
    reads = mapped.read_ids(m, unk, m.target_vocab)
    t2d = m.target_to_draft
    inside = int(inter.slot_ids[5])
    outside = int(torch.nonzero(t2d < 0).flatten()[-1])
    ex = Example([inside, outside], [outside, inside], [[inside, outside]] * 2, [[-0.1, -3.0]] * 2)
    got = mapped.map_example(ex, reads, inter)
    row = int(inter.served_row[inside])
    assert int(m.draft_to_target[row]) == inside and int(t2d[inside]) == row
    assert got.prompt_ids == [row, unk] and got.completion_ids == [unk, row]
    assert got.topk_ids == [[row, -1]] * 2 and got.topk_logprobs == ex.topk_logprobs


def _cfg(distill_cfg, out: Path, drafter: Path, *extra: str):
    return distill_cfg(
        out, f"pair.drafter={drafter}", "pair.min_vocab_coverage=0",
        "pair.coverage_prompts=toy-tiny:test", "eval.sampling.temperature=0",
        "optim.optimizer.lr=1e-2", *extra,
    )  # fmt: skip


def test_mapped_distill_raises_heldout_tli_acceptance(
    distill_cfg, tmp_path, own_drafter, seqkd_topk_dir, toy_tiny
):
    """Stored top-k rows (the target never runs in the loss), greedy serving: the held-out TLI
    acceptance (reference completions of the test prompts, through the mapping) rises; best/
    carries the drafter's own tokenizer; result.json says the pair is mapped."""
    cfg = _cfg(distill_cfg, tmp_path / "run", own_drafter, f"data.path={seqkd_topk_dir}",
               "max_steps=24", "eval_every=12", "save_every=12")  # fmt: skip
    res = train.run(cfg)
    assert res.alpha_after > res.alpha_before + 0.05, (res.alpha_before, res.alpha_after)
    assert res.data["vocab"] == "mapped" and res.data["tli_mask_unreachable"] is True
    assert res.data["topk"] is True and res.heldout_prediction is None
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["data"]["intersection"] == res.data["intersection"] > 0
    best = tmp_path / "run" / "best"
    own = json.loads((own_drafter / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((best / "tokenizer.json").read_text())["model"]["vocab"] == own


@pytest.mark.slow  # the target in the loop
def test_mapped_distill_live_target_sampling(distill_cfg, tmp_path, own_drafter, seqkd_dir):
    """A live target (no stored top-k), TVD, sampled serving (T = 1): the loss is finite and
    the held-out TLI acceptance rises."""
    cfg = _cfg(distill_cfg, tmp_path / "run", own_drafter, f"data.path={seqkd_dir}", "loss=tvd",
               "eval.sampling.temperature=1", "max_steps=16", "eval_every=16")  # fmt: skip
    res = train.run(cfg)
    assert res.data["tli_mask_unreachable"] is False and res.data["topk"] is False
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in res.history)
    assert res.alpha_after > res.alpha_before, (res.alpha_before, res.alpha_after)


@pytest.mark.parametrize(
    ("override", "field"),
    [("lmbda=0.5", "lmbda="), ("drafting=parallel", "drafting="),
     ("draft_vocab_train=true", "draft_vocab_train="), ("tli_mask_unreachable=maybe", "tli_mask")],
)  # fmt: skip
def test_mapped_settings_it_cannot_run_are_one_line(distill_cfg, tmp_path, override, field):
    cfg = distill_cfg(tmp_path / "run", override)
    with pytest.raises(ConfigError, match=field) as e:  # the form of a value: with the settings
        mapped.check_mapped_config(TrainSettings.from_cfg(cfg))
    assert "\n" not in str(e.value)


def test_shared_pairs_do_not_take_the_mapped_path(monkeypatch, distill_cfg, tmp_path):
    """A same-tokenizer pair never builds a mapping (the path stays as it was)."""

    def boom(*_a, **_k):
        raise AssertionError("the mapped path ran for a shared pair")

    monkeypatch.setattr(mapped, "prepare_mapped", boom)
    monkeypatch.setattr(sources, "build_eval_examples", lambda *a, **k: [])
    cfg = distill_cfg(tmp_path / "run", "data.seq_kd=false", "data.reference=true")
    tr = train.prepare(cfg)
    assert isinstance(tr.objective, SharedVocab) and tr.out_tok is tr.tok
