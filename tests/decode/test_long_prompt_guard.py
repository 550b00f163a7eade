"""The context-length guard: a prompt + max_new_tokens + the verify's drafts longer than the
target's context (toy-tiny: 512 positions) is never silently wrapped. validate (and bench,
through the same `setup`) fits prompts by `long_prompts`: truncate (default) keeps the last
tokens and records the count, skip drops them, error refuses in one line naming the count.
Long prompts come from `dataset=stdlib-long`, which is what this guard is for.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.prompts import fit_to_context, load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.decode.validate.setup import setup
from specdistill.decode.validate.stage import main
from tests.conftest import main_in_process

# One short prompt (<= 256 tokens) and one far past toy-tiny's 512 positions, in that order.
LONG = ["dataset=stdlib-long", "dataset.buckets=[0-256,1k-2k]", "dataset.per_bucket=1"]
QUICK = ["pair=toy-tiny", "max_new_tokens=4", "repeats=1", "step_time_iters=1", "num_prompts=2"]
QUICK += ["both_modes=false", "hf_assisted=false", "plot=false"]


def _cfg(*overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="validate", overrides=[*QUICK, *LONG, *overrides])


def test_fit_to_context_policies():
    ids = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [7]]
    assert fit_to_context(ids, 4, "truncate", context="c") == (
        [0, 1, 2],
        [[1, 2, 3], [3, 4, 5, 6], [7]],
        1,
    )
    assert fit_to_context(ids, 4, "skip", context="c") == ([0, 2], [[1, 2, 3], [7]], 1)
    assert fit_to_context(ids, 6, "error", context="c") == ([0, 1, 2], ids, 0)
    with pytest.raises(ConfigError) as err:
        fit_to_context(ids, 4, "error", context="the context leaves")
    message = str(err.value)
    assert message.startswith("1 of 3 prompts are longer than the 4 prompt tokens the context")
    assert "long_prompts=truncate" in message and "\n" not in message


@pytest.mark.usefixtures("one_thread")
def test_truncate_keeps_the_last_tokens_and_counts_them(toy_tiny):
    cfg = _cfg()
    st = setup(cfg, 4)
    budget = 512 - 4 - 4 - 2  # context - max_new_tokens - drafts - 2, as validate's room
    prompts = load_prompts(cfg.dataset, st.tok, default_split="test")[:2]
    full = [st.tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    assert len(full[0]) <= 256 < 1024 < len(full[1])  # one short, one past the context
    assert st.prompt_fit == {
        "policy": "truncate",
        "max_prompt_tokens": budget,
        "context": 512,
        "long": 1,
        "chat_turns_cut": 0,  # plain prompts: nothing re-rendered by turns
        "truncated": 1,
        "skipped": 0,
    }
    (ids0, _), (ids1, mask1) = st.batches
    assert ids0[0].tolist() == full[0]
    assert ids1[0].tolist() == full[1][-budget:] and int(mask1.sum()) == budget
    assert st.buckets == ["0-256", "1k-2k"]


@pytest.mark.usefixtures("one_thread")
def test_skip_drops_the_long_prompt(toy_tiny):
    st = setup(_cfg("long_prompts=skip"), 4)
    assert st.prompt_fit["skipped"] == 1 and st.buckets == ["0-256"] and len(st.batches) == 1


@pytest.mark.usefixtures("one_thread")
def test_error_is_one_line_naming_the_count_and_the_fix(toy_tiny, tmp_path, monkeypatch, capsys):
    argv = ["validate", *QUICK, *LONG, "long_prompts=error", f"output_dir={tmp_path}"]
    code, lines = main_in_process(main, argv, monkeypatch, capsys)
    assert code == 2
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]]
    assert errors[0].startswith(
        "error: 1 of 2 prompts are longer than the 498 prompt tokens"
    )  # 512-4-8-2
    assert "512-token context" in errors[0] and "long_prompts=truncate" in errors[0]
    assert not (tmp_path / "report.json").exists()


@pytest.mark.usefixtures("one_thread")
def test_validate_records_the_truncation_and_stays_lossless(
    toy_tiny, tmp_path, monkeypatch, capsys
):
    argv = ["validate", *QUICK, *LONG, f"output_dir={tmp_path}"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["prompt_fit"]["truncated"] == 1 and report["prompts"] == 2
    assert report["lossless"] is True
    assert any(n.startswith("long_prompts=truncate: 1 prompts over") for n in report["notes"])
