"""Validate by benchmark set and category, and multi-turn questions decoded after the target's
own answers: the aggregation against brute force, the turn expansion, and the stage end to end."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.prompt_record import Prompt
from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.validate.categories import (
    category_markdown,
    category_rows,
    groups,
    labels,
)
from specdistill.decode.validate.modes import TimedPass, merge
from specdistill.decode.validate.turns import expand_turns, greedy_answers
from tests.data.chat_fixtures import chat_tokenizer, write_jsonl

# ----------------------------------------------------------------------------- aggregation


def _out(rng: random.Random, k: int = 3) -> DecodeOutput:
    """A decode's counters as the decoder keeps them: rounds with 0..k accepted drafts."""
    rounds = [rng.randint(0, k) for _ in range(rng.randint(1, 6))]
    accepted_at, trials_at = [0] * k, [0] * k
    for a in rounds:  # drafts 1..a accepted, draft a+1 (if any) tried and rejected
        for j in range(min(a + 1, k)):
            trials_at[j] += 1
            accepted_at[j] += j < a
    trials = sum(trials_at)
    return DecodeOutput(
        tokens=[[1] * (sum(rounds) + len(rounds))],
        block_tokens=sum(a + 1 for a in rounds),
        row_rounds=len(rounds),
        alpha_sum=rng.random() * trials,
        trials=trials,
        accepted=sum(accepted_at),
        accepted_at=accepted_at,
        trials_at=trials_at,
    )


def test_category_rows_equal_brute_force_pooling_over_each_groups_rounds():
    rng = random.Random(0)
    keys = [("mt", "writing"), ("mt", "math"), ("gsm", "all"), ("mt", "writing"), ("gsm", "all")]
    outs = {m: [_out(rng) for _ in keys] for m in ("greedy", "sampling")}
    secs = [rng.uniform(0.5, 2) for _ in keys]
    passes = {
        m: [TimedPass(secs, [_out(rng) for _ in keys], [s / 2 for s in secs], outs[m])]
        for m in outs
    }
    rows = category_rows(keys, passes)
    names = [(r["set"], r["category"], r["mode"]) for r in rows]
    assert names[:5] == [
        ("mt", "writing", "greedy"),
        ("mt", "math", "greedy"),
        ("mt", "all", "greedy"),
        ("gsm", "all", "greedy"),  # one category: no repeated `all` row
        ("all", "all", "greedy"),
    ]
    assert len(rows) == 10
    for r in rows:
        idx = [
            i
            for i, (s, c) in enumerate(keys)
            if r["set"] in ("all", s) and r["category"] in ("all", c)
        ]
        mine = [outs[r["mode"]][i] for i in idx]
        assert r["prompts"] == len(idx)
        rounds = sum(o.row_rounds for o in mine)
        assert r["tau"] == round(sum(o.block_tokens for o in mine) / rounds, 3)
        assert r["alpha"] == round(sum(o.alpha_sum for o in mine) / sum(o.trials for o in mine), 4)
        for j, x in enumerate(r["acceptance_by_position"]):
            t = sum(o.trials_at[j] for o in mine)
            assert x == (round(sum(o.accepted_at[j] for o in mine) / t, 4) if t else 0.0)
    text = "\n".join(category_markdown(rows))
    assert "## By benchmark and category" in text and "| mt | writing | 2 |" in text


def test_batched_decodes_give_the_category_figures_of_their_rows():
    """Batches of two prompts (per-row counters kept, as the decoder keeps them): every
    category's acceptance figures equal those of the same prompts decoded one per batch; the
    speedup by category needs prompts timed alone, so it is None."""
    rng = random.Random(1)
    keys = [("mt", "writing"), ("mt", "math"), ("gsm", "all"), ("mt", "writing"), ("gsm", "all")]
    outs = [_out(rng) for _ in keys]
    secs = [1.0] * len(keys)
    alone = category_rows(keys, {"greedy": [TimedPass(secs, outs, secs, outs)]})
    batched = [merge(outs[i : i + 2]) for i in range(0, len(outs), 2)]  # 2, 2, 1 rows
    assert [len(b.tokens) for b in batched] == [2, 2, 1] and len(batched[0].by_row) == 2
    together = category_rows(keys, {"greedy": [TimedPass([1.0] * 3, batched, [1.0] * 3, batched)]})
    figures = ("prompts", "tau", "alpha", "drafter_alpha", "acceptance_by_position", "trials")
    assert [{f: r[f] for f in figures} for r in together] == [
        {f: r[f] for f in figures} for r in alone
    ]
    assert all(r["speedup"] is None for r in together) and all(r["speedup"] for r in alone)
    assert "| - |" in "\n".join(category_markdown(together))


def test_batches_hold_prompts_of_similar_length():
    from specdistill.decode.validate.setup import by_length

    rows = [[1] * n for n in (5, 1, 3, 1, 4, 2)]
    prompts, ordered = by_length(list("abcdef"), rows)
    assert [len(r) for r in ordered] == [1, 1, 2, 3, 4, 5]
    assert prompts == ["b", "d", "f", "c", "e", "a"]  # ties in the set's order


def test_labels_and_groups():
    plain = [Prompt(0, "a"), Prompt(1, "b")]
    assert labels(plain, "dataset") is None
    chat = [Prompt(0, "a", category="x"), Prompt(1, "b", source="gsm"), Prompt(2, "c")]
    keys = labels(chat, "mine")
    assert keys == [("mine", "x"), ("gsm", "all"), ("mine", "other")]
    assert labels([Prompt(0, "a", category="gsm", source="gsm")], "d") == [("gsm", "all")]
    assert [(s, c, idx) for s, c, idx in groups(keys)] == [
        ("mine", "x", [0]),
        ("mine", "other", [2]),
        ("mine", "all", [0, 2]),
        ("gsm", "all", [1]),
        ("all", "all", [0, 1, 2]),
    ]


# ----------------------------------------------------------------------------- turns


def _turn_rows(tmp_path, n: int, turns: int) -> list[dict]:
    return [
        {
            "id": k,
            "category": ["writing", "math"][k % 2],
            "turns": [f'def g{k}_{t}(x):\n    """Return x times {t}."""' for t in range(turns)],
        }
        for k in range(n)
    ]


def _chat_cfg(path, **more):
    cfg = {
        "source": "jsonl",
        "path": str(path),
        "format": "turns",
        "field": "turns",
        "category_field": "category",
        "id_field": "id",
        "label": "bench",
        "split": "test",
    }
    return cfg | more


def test_later_turns_follow_the_answers_in_order(toy_tiny, tmp_path):
    tok = chat_tokenizer(toy_tiny, tmp_path / "tok")
    path = write_jsonl(tmp_path / "q.jsonl", _turn_rows(tmp_path, 2, 3))
    prompts = load_prompts(_chat_cfg(path), tok, default_split="test")
    rows = [tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    asked: list[list[int]] = []

    def answer(batch: list[list[int]]) -> list[str]:
        asked.extend(batch)
        return [f"reply{len(asked) - len(batch) + i}" for i in range(len(batch))]

    def fit(ps):
        return ps, [tok(p.text, add_special_tokens=False).input_ids for p in ps], {"long": 0}

    out, out_rows, counts = expand_turns(prompts, rows, tok, answer, fit)
    assert counts["turns"] == {1: 2, 2: 2, 3: 2} and len(out) == 6 == len(out_rows)
    assert asked[:2] == rows  # turn 2 is asked after the answers to the fitted turn-1 prompts
    by = {(p.index, p.turn): p for p in out}
    assert "<|assistant|>reply0\n" in by[(0, 2)].text and "reply1" not in by[(0, 2)].text
    assert "<|assistant|>reply0\n" in by[(0, 3)].text and "<|assistant|>reply2\n" in by[(0, 3)].text
    assert by[(0, 3)].answers == ("reply0", "reply2") and by[(1, 2)].category == "math"
    assert all(p.text.endswith("<|assistant|>") for p in out)


def test_turn_two_holds_the_targets_own_greedy_answer(toy_tiny, tmp_path):
    """Against a brute-force greedy loop (argmax of the full forward each step)."""
    from specdistill.data.models.pairs import load_pair, resolve_pair

    tok = chat_tokenizer(toy_tiny, tmp_path / "tok")
    target, _, _ = load_pair(resolve_pair({"toy": "toy-tiny"}))
    path = write_jsonl(tmp_path / "q.jsonl", _turn_rows(tmp_path, 1, 2))
    prompts = load_prompts(_chat_cfg(path), tok, default_split="test")
    rows = [tok(p.text, add_special_tokens=False).input_ids for p in prompts]
    eos = (tok.eos_token_id,)
    answer = greedy_answers(target, tok, torch.device("cpu"), 6, eos)

    def fit(ps):
        return ps, [tok(p.text, add_special_tokens=False).input_ids for p in ps], {}

    out, _, _ = expand_turns(prompts, rows, tok, answer, fit)
    ids = list(rows[0])
    with torch.no_grad():
        for _ in range(6):
            nxt = int(target(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in eos:
                break
            ids.append(nxt)
    reply = tok.decode(ids[len(rows[0]) :], skip_special_tokens=True).strip()
    assert out[1].turn == 2 and out[1].answers == (reply,)
    assert f"<|assistant|>{reply}\n" in out[1].text


# ----------------------------------------------------------------------------- the stage


def _validate_cfg(*overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="validate", overrides=list(overrides))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("batch", [1, 3])
def test_validate_reports_by_category_with_both_turns(toy_tiny, tmp_path, batch):
    from specdistill.decode.validate.stage import run

    tok_dir = tmp_path / "tok"
    chat_tokenizer(toy_tiny, tok_dir)
    path = write_jsonl(tmp_path / "q.jsonl", _turn_rows(tmp_path, 4, 2))
    out = tmp_path / "v"
    cfg = _validate_cfg(
        "pair=toy-tiny",
        f"+pair.tokenizer={tok_dir}",
        "dataset.source=jsonl",
        f"+dataset.path={path}",
        "+dataset.format=turns",
        "dataset.field=turns",
        "+dataset.category_field=category",
        "+dataset.id_field=id",
        "+dataset.label=bench",
        "num_prompts=null",
        "max_new_tokens=6",
        "step_time_iters=2",
        "hf_assisted=false",
        "recommend_max_k=0",
        "progress=false",
        f"batch_size={batch}",
        f"output_dir={out}",
    )
    r = run(cfg)
    assert r.prompts == 8 and r.prompt_fit["turns"] == {1: 4, 2: 4} and r.lossless is True
    rows = {(x["set"], x["category"], x["mode"]): x for x in r.categories}
    assert set(rows) == {
        ("bench", c, m) for c in ("writing", "math", "all") for m in ("greedy", "sampling")
    }
    assert rows[("bench", "writing", "greedy")]["prompts"] == 4
    whole = rows[("bench", "all", "greedy")]
    assert whole["tau"] == r.modes["greedy"]["tau"] and whole["alpha"] == r.modes["greedy"]["alpha"]
    assert rows[("bench", "all", "sampling")]["tau"] == r.modes["sampling"]["tau"]
    assert (rows[("bench", "math", "greedy")]["speedup"] is None) == (batch > 1)
    report = json.loads((out / "report.json").read_text())
    assert report["categories"] == r.categories
    assert "## By benchmark and category" in (out / "report.md").read_text()
    assert (out / "report_categories.png").stat().st_size > 0


def test_validate_refuses_prompts_among_the_training_rows(toy_tiny, tmp_path):
    import datasets

    from specdistill.decode.validate.stage import run

    tok_dir = tmp_path / "tok"
    tok = chat_tokenizer(toy_tiny, tok_dir)
    path = write_jsonl(tmp_path / "q.jsonl", _turn_rows(tmp_path, 3, 1))
    first = load_prompts(_chat_cfg(path), tok, default_split="test")[1].text
    datasets.Dataset.from_dict({"prompt": ["other", first]}).save_to_disk(str(tmp_path / "seqkd"))
    cfg = _validate_cfg(
        "pair=toy-tiny",
        f"+pair.tokenizer={tok_dir}",
        "dataset.source=jsonl",
        f"+dataset.path={path}",
        "+dataset.format=turns",
        "dataset.field=turns",
        "+dataset.id_field=id",
        f"training_data={tmp_path / 'seqkd'}",
        f"output_dir={tmp_path / 'v'}",
    )
    with pytest.raises(ConfigError, match=r"1 of 3 evaluation prompts .* are training rows"):
        run(cfg)


def test_drafters_side_by_side_by_category(tmp_path):
    from specdistill.distill.pipeline.category_report import category_table, plot_categories

    def row(s, c, mode, tau):
        return {"set": s, "category": c, "mode": mode, "prompts": 2, "tau": tau, "alpha": 0.5,
                "acceptance_by_position": [0.5, 0.25]}  # fmt: skip

    base = [row("mt", "math", "greedy", 1.0), row("gsm", "all", "greedy", 1.1)]
    mine = [row("mt", "math", "greedy", 2.0), row("gsm", "all", "greedy", 2.5)]
    stages = {"validate_base": {"categories": base}, "validate": {"categories": mine},
              "validate_drafter_code": {"categories": base[:1]}}  # fmt: skip
    text = "\n".join(category_table(stages))
    assert "| set | category | prompts | tau base | tau distilled | tau code |" in text
    assert "| mt | math | 2 | 1.00 | 2.00 | 1.00 | 0.500 | 0.500 | 0.500 | 0.50 0.25 |" in text
    assert "| gsm | all | 2 | 1.10 | 2.50 | - |" in text  # a drafter without the row: '-'
    assert plot_categories(stages, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size
