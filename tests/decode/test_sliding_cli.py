"""The validate stage on user-brought sliding-window pairs, as a new user runs it: tiny random
checkpoints saved with `save_pretrained` beside the toy-tiny tokenizer, `pair.toy=null`.

p = target, q = drafter. Windows (6 tokens) are far shorter than prompt + new tokens.
"""

from __future__ import annotations

import json

import pytest

from tests.decode.sliding_models import gemma2, mistral
from tests.decode.test_errors_and_cli import _cli


def _save(model, path, tok):
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)  # as a user ships a checkpoint: its tokenizer beside it
    return str(path)


@pytest.fixture(scope="module")
def tok(toy_tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_tiny.tokenizer_dir)


def _pair_args(target: str, drafter: str, tokenizer: str) -> list[str]:
    return [
        "pair.toy=null",
        f"pair.target={target}",
        f"pair.drafter={drafter}",
        f"pair.tokenizer={tokenizer}",
        "dataset.toy=toy-tiny",
        "num_prompts=2",
        "max_new_tokens=16",
        "repeats=1",
        "step_time_iters=2",
        "both_modes=false",
    ]


@pytest.mark.parametrize(
    "make,extra", [(mistral, []), (gemma2, ["batch_size=2", "decoder.cache=static"])]
)
def test_validate_sliding_pair_is_lossless(tmp_path, tok, toy_tiny, make, extra):
    v = len(tok)
    target = _save(make(vocab=v, layers=2, seed=0).eval(), tmp_path / "T", tok)
    drafter = _save(make(vocab=v, layers=1, seed=1).eval(), tmp_path / "D", tok)
    out = tmp_path / "out"
    r = _cli(*_pair_args(target, drafter, str(toy_tiny.tokenizer_dir)), f"output_dir={out}", *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["lossless"] is True and report["mismatched_sequences"] == 0


def test_validate_refuses_a_recurrent_drafter_in_one_line(tmp_path, tok, toy_tiny):
    from transformers import MambaConfig, MambaForCausalLM

    v = len(tok)
    target = _save(mistral(vocab=v, layers=1).eval(), tmp_path / "T", tok)
    mamba = MambaForCausalLM(
        MambaConfig(vocab_size=v, hidden_size=16, state_size=4, num_hidden_layers=1)
    )
    drafter = _save(mamba, tmp_path / "D", tok)
    r = _cli(*_pair_args(target, drafter, str(toy_tiny.tokenizer_dir)), f"output_dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: pair.drafter={drafter} (mamba) cannot be used"), last
