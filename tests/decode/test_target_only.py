"""The target-only side shared by a run's validate steps (decode/validate/target_only.py): what
its key holds, the round trip of its records, and the stage reusing it end to end."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.validate.target_only import (
    BaselinePass,
    TargetOnlyCache,
    batches_digest,
    output_from_record,
    output_record,
    shared_answers,
)
from tests.data.chat_fixtures import chat_tokenizer, write_jsonl


def _cache(tmp_path, machine: str = "cpu x") -> TargetOnlyCache:
    return TargetOnlyCache.create(
        tmp_path / "shared", "hub/model", None, torch.device("cpu"), torch.float32, machine
    )


def test_a_target_only_output_survives_its_record():
    row = DecodeOutput(tokens=[], target_forwards=3, draft_lengths=[3], accepted_at=[0, 0])
    out = DecodeOutput(tokens=[[1, 2, 3], [4]], target_forwards=3, by_row=[row, row])
    back = output_from_record(json.loads(json.dumps(output_record(out))))
    assert back == out


def test_a_speculative_output_is_refused():
    from specdistill.decode.outputs import RoundRecord

    r = RoundRecord([0], torch.zeros(1, 1), torch.zeros(1), torch.zeros(1), [True])
    with pytest.raises(ValueError, match="no rounds"):
        output_record(DecodeOutput(tokens=[[1]], rounds=[r]))


def test_passes_are_keyed_by_everything_that_decides_them(tmp_path):
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    one = DecodeOutput(tokens=[[1], [2]], target_forwards=1)
    timed = [BaselinePass([0.5], [one]), BaselinePass([0.25], [one])]
    key = {"batches": batches_digest([(ids, mask)]), "seed": 0}
    cache = _cache(tmp_path)
    assert cache.load_passes(key, 1) is None
    cache.save_passes(key, timed)
    assert cache.load_passes(key, 2) == timed
    assert cache.load_passes(key, 1) == timed[:1]
    assert cache.load_passes(key, 3) is None  # fewer repeats timed than asked
    assert cache.load_passes(key | {"seed": 1}, 1) is None
    assert _cache(tmp_path, machine="cpu y").load_passes(key, 1) is None  # another machine
    # the same prompts batched otherwise, or padded otherwise, are other passes
    assert batches_digest([(ids[:1], mask[:1]), (ids[1:], mask[1:])]) != key["batches"]
    assert batches_digest([(ids, torch.ones_like(mask))]) != key["batches"]
    # a torn file is decoded again, not trusted
    path = next((tmp_path / "shared").glob("passes-*.json"))
    path.write_text("{not json")
    assert cache.load_passes(key, 1) is None


def test_a_folder_that_cannot_be_made_is_one_error(tmp_path):
    from specdistill.data.runtime import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"target_only_cache=.*file/shared.*writable folder"):
        TargetOnlyCache.create(
            tmp_path / "file" / "shared", "m", None, torch.device("cpu"), torch.float32, "x"
        )


def test_answers_are_asked_once_per_rows_and_settings(tmp_path):
    asked: list[list[int]] = []

    def answer(rows: list[list[int]]) -> list[str]:
        asked.extend(rows)
        return [f"reply to {r}" for r in rows]

    cache = _cache(tmp_path)
    first = shared_answers(cache, answer, {"max_new_tokens": 4})
    again = shared_answers(cache, answer, {"max_new_tokens": 4})
    longer = shared_answers(cache, answer, {"max_new_tokens": 8})
    assert first([[1, 2], [3]]) == ["reply to [1, 2]", "reply to [3]"]
    assert again([[1, 2], [3]]) == ["reply to [1, 2]", "reply to [3]"] and len(asked) == 2
    longer([[1, 2], [3]])
    again([[1, 2]])
    assert len(asked) == 5
    assert shared_answers(None, answer, {}) is answer


def _rows(n: int) -> list[dict]:
    return [
        {
            "id": k,
            "category": ["writing", "math"][k % 2],
            "turns": [f'def h{k}_{t}(x):\n    """Return x plus {t}."""' for t in range(2)],
        }
        for k in range(n)
    ]


@pytest.mark.usefixtures("one_thread")
def test_validate_steps_reuse_the_target_only_side(toy_tiny, tmp_path, monkeypatch):
    """A second validate step with the same cache decodes no target-only pass and asks no
    earlier-turn answer, and reports what a step without the cache reports."""
    from specdistill.decode.speculative import SpeculativeDecoder
    from specdistill.decode.validate import setup, stage

    tok_dir = tmp_path / "tok"
    chat_tokenizer(toy_tiny, tok_dir)
    path = write_jsonl(tmp_path / "q.jsonl", _rows(4))
    calls: list[int] = []
    asked: list[int] = []
    baseline, answers = SpeculativeDecoder.baseline, setup.greedy_answers

    def counted_baseline(self, ids, mask=None, generator=None):
        calls.append(ids.shape[0])
        return baseline(self, ids, mask, generator)

    def counted_answers(*args, **kwargs):
        inner = answers(*args, **kwargs)

        def answer(rows):
            asked.append(len(rows))
            return inner(rows)

        return answer

    monkeypatch.setattr(SpeculativeDecoder, "baseline", counted_baseline)
    monkeypatch.setattr(setup, "greedy_answers", counted_answers)

    def run(name: str, *more: str):
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            cfg = compose(
                config_name="validate",
                overrides=[
                    "pair=toy-tiny", f"+pair.tokenizer={tok_dir}", "dataset.source=jsonl",
                    f"+dataset.path={path}", "+dataset.format=turns", "dataset.field=turns",
                    "+dataset.category_field=category", "+dataset.id_field=id",
                    "num_prompts=null", "max_new_tokens=6", "step_time_iters=2",
                    "hf_assisted=false", "recommend_max_k=0", "progress=false", "plot=false",
                    "batch_size=3", f"output_dir={tmp_path / name}", *more,
                ],
            )  # fmt: skip
        calls.clear()
        asked.clear()
        return stage.run(cfg)

    shared = f"target_only_cache={tmp_path / 'shared'}"
    plain = run("plain")
    assert calls == [1, 3, 3, 2, 1, 3, 3, 2] and asked == [4]  # warm-up, 3 batches; both modes
    first = run("first", shared)
    assert calls == [1, 3, 3, 2, 1, 3, 3, 2] and asked == [4]
    second = run("second", shared)
    assert calls == [1, 1] and asked == []  # the untimed warm-ups only
    assert second.lossless is True and second.prompt_fit == plain.prompt_fit
    for mode in ("greedy", "sampling"):
        mine, theirs = second.modes[mode], first.modes[mode]
        assert not theirs["baseline_reused"] and mine["baseline_reused"]
        assert mine["baseline_tokens_per_s"] == theirs["baseline_tokens_per_s"]
        for key in ("tau", "acceptance_by_position", "alpha", "accepted_at", "trials_at"):
            assert mine[key] == plain.modes[mode][key]
    assert second.categories is not None
    assert [r["tau"] for r in second.categories] == [r["tau"] for r in plain.categories]
    assert any("target-only tokens and timing from another validate step" in n
               for n in second.notes)  # fmt: skip
    assert not any("another validate step" in n for n in first.notes)
    run("reseeded", shared, "seed=1")  # another seed: other passes, decoded
    assert calls == [1, 3, 3, 2, 1, 3, 3, 2]
