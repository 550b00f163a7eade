"""The distill stage end to end on toy-tiny: alpha rises, top-k mode, resume, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import setup
from specdistill.distill.train import stage as train
from tests.distill.conftest import Crash, crash_after


@pytest.mark.slow  # builds a Seq-KD set, trains, evaluates
def test_distillation_raises_heldout_alpha(distill_cfg, tmp_path, seqkd_dir):
    cfg = distill_cfg(tmp_path / "run", f"data.path={seqkd_dir}", "max_steps=12", "eval_every=6")
    res = train.run(cfg)
    assert res.alpha_after > res.alpha_before + 0.01, (res.alpha_before, res.alpha_after)
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    for key in ("alpha_before", "alpha_after", "drafter_path", "tokens_per_s", "peak_memory_mb"):
        assert key in saved
    assert saved["steps"] == 12 and saved["loss"]["name"] == "fkl"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    best = AutoModelForCausalLM.from_pretrained(saved["drafter_path"])
    AutoTokenizer.from_pretrained(saved["drafter_path"])
    assert best.config.vocab_size > 0 and (tmp_path / "run" / "final" / "config.json").exists()


@pytest.mark.slow  # builds a Seq-KD set, trains, evaluates
def test_topk_mode_trains_without_loading_the_target(
    distill_cfg, tmp_path, seqkd_topk_dir, monkeypatch
):
    def no_target(*a, **k):
        raise AssertionError("the target must not be loaded in top-k mode")

    monkeypatch.setattr(setup, "load_target", no_target)
    cfg = distill_cfg(
        tmp_path / "run", f"data.path={seqkd_topk_dir}", "eval.source=path",
        f"eval.path={seqkd_topk_dir}", "max_steps=8", "eval_every=8", "loss=jsd",
    )  # fmt: skip
    res = train.run(cfg)
    assert res.data["topk"] is True
    assert res.alpha_after > res.alpha_before


def _weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow  # builds a Seq-KD set, trains, evaluates
def test_resume_after_a_crash_matches_an_uninterrupted_run(
    distill_cfg, tmp_path, seqkd_dir, monkeypatch
):
    common = (f"data.path={seqkd_dir}", "max_steps=6", "save_every=2", "eval_every=3", "lmbda=0.5",
              "onpolicy.max_new_tokens=8")  # fmt: skip
    ref = train.run(distill_cfg(tmp_path / "ref", *common))
    # killed after step 5, whose checkpoint was never written (the last one: step 4)
    crash_after(monkeypatch, 5)
    with pytest.raises(Crash):
        train.run(distill_cfg(tmp_path / "run", *common))
    state = json.loads((tmp_path / "run/checkpoints/step-00000004/trainer_state.json").read_text())
    assert state["step"] == 4 and state["examples_seen"] == 4 * 4
    monkeypatch.setattr(train, "STEP_HOOK", None)
    res = train.run(distill_cfg(tmp_path / "run", *common, "resume=true"))
    assert res.steps == 6
    assert [h["step"] for h in res.history] == [1, 2, 3, 4, 5, 6]
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history]
    a, b = _weights(tmp_path / "ref" / "final"), _weights(tmp_path / "run" / "final")
    for k in a:  # same process, same data, same RNG: bit-identical (tolerance 0)
        assert torch.equal(a[k], b[k]), k
    assert res.alpha_after == ref.alpha_after


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["lmbda=1.5"], "lmbda"),
        (["loss.beta=-0.1"], "loss.beta"),
        (["data.path=/nonexistent/seqkd"], "data.path"),
        (["data.seq_kd=false"], "data.path"),
    ],
)
def test_bad_input_names_the_field(distill_cfg, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        train.run(distill_cfg(tmp_path / "run", *overrides))


def test_empty_dataset_is_an_error(distill_cfg, tmp_path):
    import datasets

    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"prompt_ids": [], "completion_ids": []}).save_to_disk(str(empty))
    with pytest.raises(ConfigError, match=r"data\.path"):
        train.run(distill_cfg(tmp_path / "run", f"data.path={empty}"))


def test_drafter_with_another_vocab_is_an_error(distill_cfg, tmp_path, seqkd_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other_drafter"
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, **small)).save_pretrained(other)
    cfg = distill_cfg(tmp_path / "run", f"data.path={seqkd_dir}", f"pair.drafter={other}")
    with pytest.raises(ConfigError, match=r"pair\.drafter|vocab"):
        train.run(cfg)


def test_cli_prints_one_line_error_and_exits_2(distill_cfg, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specdistill.distill.train", "pair=toy-tiny", "lmbda=2",
         f"output_dir={tmp_path}", "logger=none"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "error: lmbda=2" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # target continuations, a few steps, replays
def test_result_predicts_decode_figures_from_the_heldout_set(distill_cfg, tmp_path, seqkd_dir):
    """Greedy serving on the target's own continuations: result.json carries best/'s replayed
    decode figures (exact replay; nothing timed: default costs, outcomes kept for validate's)
    for fixed gamma and both policies; tau of fixed gamma 4 is 1 + the expected accepted
    prefix, so it sits in [1, 5] and rises with the greedy agreement."""
    cfg = distill_cfg(
        tmp_path / "run", f"data.path={seqkd_dir}", "max_steps=4", "eval_every=4",
        "eval.source=target", "eval.sampling.temperature=0", "eval.limit=4",
        "eval.max_new_tokens=16",
    )  # fmt: skip
    from specdistill.distill.train.predict import UNCALIBRATED

    res = train.run(cfg)
    pred = json.loads((tmp_path / "run" / "result.json").read_text())["heldout_prediction"]
    assert pred["exact"] and pred["rows"] == 4 and pred["costs"]["source"] == UNCALIBRATED
    assert len(pred["outcomes"]) == 4 and (pred["gamma"], pred["p_min"]) == (4, 0.75)
    assert set(pred["figures"]) == {"gamma=4", "heuristic", "confidence"}
    fixed = pred["figures"]["gamma=4"]
    assert 1.0 <= fixed["tau"] <= 5.0 and fixed["mean_draft_length"] <= 4.0
    assert fixed["target_step_share"] == 0.0 and fixed["speedup"] > 0
    assert len(fixed["acceptance_by_position"]) <= 4
    # all-rejected drafts give tau 1, all-accepted 5: agreement in between lands in between
    assert (fixed["tau"] > 1.0) == (res.greedy_agreement_after > 0.0)


def test_prediction_is_skipped_for_sampling_serving(distill_cfg, tmp_path):
    """No replay at temperature > 0: the teacher-forced string is not the sampled decode's."""
    from types import SimpleNamespace

    from specdistill.data.sampling import Sampling
    from specdistill.distill.train.predict import heldout_prediction
    from specdistill.distill.train.settings import TrainSettings

    s = TrainSettings.from_cfg(distill_cfg(tmp_path / "run"))
    tr = SimpleNamespace(eval_sampling=Sampling(temperature=1.0), eval_batches=[{}])
    assert heldout_prediction(tr, None, s) is None


def test_a_cut_chat_prompt_keeps_its_head_and_its_end():
    """Over max_seq_len, a chat row keeps its system prompt + header (prompt_head tokens) and
    the end nearest its reply; the oldest middle goes. Without a head: the end only."""
    from specdistill.distill.train.data import Example, collate, fit_prompt, prompts_cut

    ids = list(range(100, 120))
    assert fit_prompt(ids, 8, 3) == [100, 101, 102, 115, 116, 117, 118, 119]
    assert fit_prompt(ids, 8, 0) == ids[-8:]
    assert fit_prompt(ids, 30, 3) == ids
    assert fit_prompt(ids, 3, 3) == ids[-3:]  # no room beyond the head: the end wins
    row = Example(prompt_ids=ids, completion_ids=[7, 8], prompt_head=3)
    batch = collate([row], pad_id=0, max_seq_len=10)
    assert batch["input_ids"][0].tolist() == [100, 101, 102, 115, 116, 117, 118, 119, 7, 8]
    assert prompts_cut([row, Example([1], [2])], 10) == 1
