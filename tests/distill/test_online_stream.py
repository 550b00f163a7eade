"""The online stream: disjoint sources, a deterministic plan, blending, and the pipeline stage."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.data.runtime import ConfigError
from specdistill.data.toy.stream import (
    SOURCE_GROUPS,
    STREAM_GROUPS,
    TEXT_GROUPS,
    group_files,
    group_prompts,
    text_prompts,
)
from specdistill.data.toy.world import read_jsonl
from specdistill.distill.online.stream import boundaries, parse_stream, plan_requests


def test_stream_groups_are_disjoint_and_outside_the_toy_corpus(toy_tiny):
    """No group shares a file with another, with the toy world's corpus (train or held-out,
    so with no training prompt either) or a prompt text with the training prompts."""
    from specdistill.data.toy.corpus import SKIP_DIRS, corpus_files, stdlib_dir

    train_rows = read_jsonl(toy_tiny.train_prompts)
    train_modules = {r["module"] for r in train_rows}
    train_texts = {r["prompt"] for r in train_rows}
    base = stdlib_dir()
    train_files, held_files = corpus_files()
    corpus = {p.relative_to(base).as_posix() for p in [*train_files, *held_files]}
    seen: set[str] = set()
    for group in SOURCE_GROUPS:
        files = {p.relative_to(base).as_posix() for p in group_files(group)}
        rows = group_prompts(group)
        assert len(rows) >= 150, group
        modules = {r["module"] for r in rows}
        assert modules <= files, group
        assert not files & corpus and not modules & train_modules, group
        assert not {r["prompt"] for r in rows} & train_texts, group
        assert not files & seen, group
        seen |= files
        if group in TEXT_GROUPS:
            assert all(not f.endswith(".py") for f in files), group  # the corpus is *.py only
        else:
            assert {m.split("/")[0] for m in modules} <= set(STREAM_GROUPS[group]) <= SKIP_DIRS


def test_text_prompts_are_whole_lines_without_a_trailing_newline():
    text = "".join(f"line {i} " + "x" * 50 + "\n" for i in range(40))
    rows = text_prompts(text, "m.txt")
    assert [r["name"] for r in rows[:3]] == ["L1", "L7", "L13"]
    for r in rows:
        assert not r["prompt"].endswith("\n") and r["completion"].startswith("\n")
        assert 400 - 60 <= len(r["prompt"]) <= 800
        assert text.index(r["prompt"] + r["completion"]) >= 0  # contiguous in the file


def test_plan_is_deterministic_sharp_or_blended():
    segs = parse_stream(
        [{"dataset": "toy-test", "requests": 10}, {"dataset": "stdlib-gui", "requests": 6}]
    )
    sizes = {"toy-test": 7, "stdlib-gui": 50}
    sharp = plan_requests(segs, sizes, blend=0, seed=3)
    assert [r.id for r in sharp] == list(range(16))
    assert [r.source for r in sharp] == ["toy-test"] * 10 + ["stdlib-gui"] * 6
    assert sharp == plan_requests(segs, sizes, blend=0, seed=3)
    firsts = [r.prompt for r in sharp[:7]]
    assert sorted(firsts) == list(range(7))  # a permutation, cycled only past the source's size
    assert [r.prompt for r in sharp[7:10]] == firsts[:3]
    assert boundaries(segs) == [10]
    blended = plan_requests(segs, sizes, blend=6, seed=3)
    assert [r.segment for r in blended] == [r.segment for r in sharp]
    mixed = [r.source for r in blended[:10]]
    assert mixed[:4] == ["toy-test"] * 4 and "stdlib-gui" in mixed[4:]
    # no prompt of a source is served twice before it has served them all
    gui = [r.prompt for r in blended if r.source == "stdlib-gui"]
    assert len(set(gui)) == len(gui)


def test_bad_stream_entries_name_the_field():
    with pytest.raises(ConfigError, match=r"stream\[1\]\.dataset='python2'"):
        parse_stream(
            [{"dataset": "toy-test", "requests": 1}, {"dataset": "python2", "requests": 1}]
        )
    with pytest.raises(ConfigError, match=r"stream\[0\]\.requests=-1"):
        parse_stream([{"dataset": "toy-test", "requests": -1}])
    with pytest.raises(ConfigError, match=r"stream\[0\]\.dataset\.source='ftp'"):
        parse_stream([{"dataset": {"source": "ftp"}, "requests": 1}])


def test_pipeline_runs_online_between_distill_and_validate(tmp_path):
    """stages=[online, validate]: online adapts pair.drafter, validate takes the adapted one."""
    from specdistill.distill.pipeline import stage as pipeline

    run_dir = tmp_path / "run"
    overrides = [
        "pair=toy-tiny",
        f"run_dir={run_dir}",
        "stages=[online,validate]",
        "++online.logger=none",
        "++online.stream=[{dataset:toy-test,requests:2},{dataset:stdlib-gui,requests:2}]",
        "++online.max_new_tokens=12",
        "++online.window=2",
        "++online.update_every=2",
        "++online.guard_probe=1",
        "++online.plot=false",
        "++validate.num_prompts=2",
        "++validate.max_new_tokens=12",
        "++validate.repeats=1",
        "++validate.step_time_iters=2",
        "++validate.plot=false",
        "++validate.hf_assisted=false",
    ]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=overrides)
    result = pipeline.run(cfg)
    adapted = result.stages["online"]["drafter_path"]
    assert adapted == str(run_dir / "online" / "drafter")
    assert read_json(run_dir / "validate" / "report.json")["drafter"] == adapted
    assert len((run_dir / "online" / "online.jsonl").read_text().splitlines()) == 2
