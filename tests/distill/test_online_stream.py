"""The online stream: disjoint sources, a deterministic plan, blending, and the pipeline stage."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.data.pairs import ConfigError
from specdistill.data.toy import read_jsonl
from specdistill.data.toy_stream import STREAM_GROUPS, group_prompts
from specdistill.distill.online_stream import boundaries, parse_stream, plan_requests


def test_stream_groups_are_disjoint_packages_outside_the_training_prompts(toy_tiny):
    train_modules = {r["module"] for r in read_jsonl(toy_tiny.train_prompts)}
    train_top = {m.split("/")[0] for m in train_modules}
    seen: set[str] = set()
    for group, packages in STREAM_GROUPS.items():
        rows = group_prompts(group)
        assert len(rows) >= 200, group
        tops = {r["module"].split("/")[0] for r in rows}
        assert tops <= set(packages), (group, tops)
        assert not tops & train_top, group
        assert not tops & seen
        seen |= tops
    # and the full toy world's corpus never contains them either (its skip list)
    from specdistill.data.toy import _SKIP_DIRS

    assert seen <= _SKIP_DIRS


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
    from specdistill.distill import pipeline

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
