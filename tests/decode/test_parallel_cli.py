"""Parallel drafting through the validate stage and `decode.bench compare_parallel`, on the
toy-tiny pair with its drafter made a (not yet trained) parallel drafter: reports carry both
drafting modes per gamma, greedy stays token-identical, bad settings name the field."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.data.runtime import ConfigError
from tests.decode.test_draft_length_cli import _cfg


@pytest.fixture(scope="module")
def parallel_drafter(tmp_path_factory, toy_tiny):
    from specdistill.distill.parallel import prepare_drafter

    out = tmp_path_factory.mktemp("parallel") / "drafter"
    model = AutoModelForCausalLM.from_pretrained(str(toy_tiny.drafter_dir))
    tok = AutoTokenizer.from_pretrained(str(toy_tiny.drafter_dir))
    prepare_drafter(model, tok.pad_token_id, 4)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def test_validate_with_parallel_drafting(tmp_path, parallel_drafter):
    from specdistill.decode.validate.stage import run

    r = run(_cfg(tmp_path, f"pair.drafter={parallel_drafter}", "decoder.drafting=parallel"))
    assert r.lossless is True
    assert any("parallel drafting: c =" in n for n in r.notes)


def test_bench_compare_parallel_side_by_side(tmp_path, parallel_drafter):
    from specdistill.decode.bench.draft import run_draft

    report = run_draft(
        _cfg(tmp_path, f"compare_parallel={parallel_drafter}", "parallel_gammas=[2,3]")
    )
    assert set(report["modes"]) == {"greedy", "sampling"}
    for name, mode in report["modes"].items():
        rows = [(r["entry"], r["drafting"], r["gamma"]) for r in mode["rows"]]
        assert rows == [("K=2", "autoregressive", 2), ("K=2-parallel", "parallel", 2),
                        ("K=3", "autoregressive", 3), ("K=3-parallel", "parallel", 3),
                        ("confidence", "autoregressive", 4),
                        ("confidence-parallel", "parallel", 4)]  # fmt: skip
        for r in mode["rows"]:
            assert r["lossless"] is (True if name == "greedy" else None)
            assert len(r["acceptance_by_position"]) == r["gamma"]
            assert r["speedup"] > 0 and 0 <= r["mean_draft_length"] <= r["gamma"]
            if r["drafting"] == "parallel":  # one forward per round (confidence: at most)
                assert 0 < r["drafter_forwards_per_round"] <= 1.0
                if r["entry"] != "confidence-parallel":
                    assert r["drafter_forwards_per_round"] == 1.0
            else:
                assert r["drafter_forwards_per_round"] >= 1.0
        agree = mode["first_draft_agreement"]
        if name == "greedy":  # one drafter weights file: the same depth-1 predictions
            assert 0 < agree["autoregressive"] == agree["parallel"] <= 1
        else:
            assert agree is None
    saved = json.loads((tmp_path / "draft.json").read_text())
    assert saved["mask_token_id"] == report["mask_token_id"]
    assert "| K=3-parallel |" in (tmp_path / "draft.md").read_text()


def test_compare_parallel_needs_a_parallel_drafter(tmp_path, toy_tiny):
    from specdistill.decode.bench.draft import run_draft

    with pytest.raises(ConfigError, match="compare_parallel="):
        run_draft(_cfg(tmp_path, f"compare_parallel={tmp_path / 'nowhere'}"))
    with pytest.raises(ConfigError, match="no mask_token_id"):
        run_draft(_cfg(tmp_path, f"compare_parallel={toy_tiny.drafter_dir}"))
    with pytest.raises(ConfigError, match="parallel_gammas="):
        run_draft(_cfg(tmp_path, f"compare_parallel={toy_tiny.drafter_dir}", "parallel_gammas=[0]"))


def test_first_draft_agreement_feeds_the_models_device():
    """Prompts stay on the host while the models may sit on a GPU (it failed there with a
    device mismatch): the probe's sequences go to the target's device. A parameter on the
    `meta` device stands in for the GPU; the stubs return fixed logits."""
    import torch

    from specdistill.decode.bench.draft import first_draft_agreement

    class Stub(torch.nn.Module):
        def __init__(self, argmax: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1, device="meta"))
            self.argmax = argmax

        def forward(self, ids):
            assert ids.device == self.w.device, ids.device
            logits = torch.zeros(ids.shape[0], ids.shape[1], 8)
            logits[..., self.argmax] = 1.0
            return type("Out", (), {"logits": logits})()

    ids, mask = torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])
    assert first_draft_agreement(Stub(3), Stub(3), [(ids, mask)], [[1, 2]]) == 1.0
    assert first_draft_agreement(Stub(3), Stub(4), [(ids, mask)], [[1, 2]]) == 0.0
