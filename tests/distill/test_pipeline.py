"""The whole pipeline on the tiny toy world: stages hand off through paths, and a rerun resumes."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.data.runtime import ConfigError
from specdistill.decode.validate.engines.ours import NO_OWN_DRAFTS
from specdistill.distill.pipeline import execute
from specdistill.distill.pipeline import stage as pipeline

FAST = [
    "pair=toy-tiny",
    "++generate.dataset.limit=12",
    "++generate.max_new_tokens=16",
    "++generate.progress=false",
    "++distill.max_steps=4",
    "++distill.eval_every=2",
    "++distill.save_every=2",
    "++distill.logger=none",
    "++distill.eval.limit=8",
    "++distill.eval.max_new_tokens=16",
    "++distill.micro_batch_size=4",
    "++validate.num_prompts=2",
    "++validate.max_new_tokens=16",
    "++validate.repeats=1",
    "++validate.step_time_iters=3",
    "++validate.plot=false",
    "++export.check.max_new_tokens=8",
]


def _cfg(run_dir, extra=()):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="pipeline", overrides=[*FAST, f"run_dir={run_dir}", *extra])


def test_pipeline_end_to_end_and_resume(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    result = pipeline.run(_cfg(run_dir))
    assert set(result.stages) == {"generate", "distill", "validate_base", "validate", "export"}
    distilled = result.stages["distill"]["drafter_path"]
    assert distilled.startswith(str(run_dir / "distill"))
    # validate ran on the distilled drafter, validate_base on the toy's base drafter
    report = read_json(run_dir / "validate" / "report.json")
    base = read_json(run_dir / "validate_base" / "report.json")
    assert json.dumps(report).count(distilled) >= 1
    assert distilled not in json.dumps(base)
    assert report["lossless"] is True and base["lossless"] is True
    assert 1.0 <= report["tau"] <= report["gamma"] + 1
    summary = read_json(run_dir / "pipeline.json")["summary"]
    assert summary["distill.alpha_before"] == result.stages["distill"]["alpha_before"]
    # The run ends with the distilled drafter exported (self-checked) and a side-by-side report.
    exported = run_dir / "export" / "drafter"
    assert result.stages["export"]["drafter"] == distilled
    assert result.stages["export"]["check"]["tokenizer_matches_target"] is True
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {
        p.name for p in exported.iterdir()
    }
    assert summary["exported_drafter"] == str(exported.absolute())
    assert "assistant_model" in summary["export.usage"]
    text = (run_dir / "summary.md").read_text()
    assert text.startswith("# specdistill run")
    assert "| figure | how measured | base drafter | distilled drafter |" in text
    alpha_row = f"| alpha, greedy | decode-time acceptance, every draft (prompt lookup's too) | {base['alpha']:.3g} | {report['alpha']:.3g} |"
    assert alpha_row in text
    own = [report["modes"]["greedy"]["drafter_alpha"], base["modes"]["greedy"]["drafter_alpha"]]
    # a drafter whose every tested draft was prompt lookup's reads n/a, not its 0.0
    cells = [
        NO_OWN_DRAFTS if r["modes"]["greedy"]["drafter_trials"] == 0 else f"{a:.3g}"
        for r, a in ((report, own[0]), (base, own[1]))
    ]
    own_row = (
        "| the drafter's own alpha, greedy | decode-time acceptance, the drafter's drafts only"
    )
    assert f"{own_row} | {cells[1]} | {cells[0]} |" in text
    assert report["drafter_alpha"] == own[0] and len(report["drafter_acceptance_by_position"]) > 0
    assert "held-out alpha, greedy" in text and str(exported.absolute()) in text
    assert "alpha, temperature 1" in text and set(report["modes"]) == {"greedy", "sampling"}
    assert (run_dir / "report.png").stat().st_size > 1000

    # A rerun with the same config finds every stage done and runs none of them.
    def boom(stage):
        raise AssertionError(f"{stage} ran again")

    monkeypatch.setattr(execute, "_stage_runner", boom)
    again = pipeline.run(_cfg(run_dir))
    assert again.stages["distill"] == result.stages["distill"]

    # A changed distill re-runs what reads its output (validate, export), not what comes before
    # it or the base drafter's validation. (The stand-in runner leaves the old result files.)
    ran: list[str] = []
    monkeypatch.setattr(execute, "_stage_runner", lambda stage: lambda cfg: ran.append(stage))
    pipeline.run(_cfg(run_dir, ["++distill.max_steps=5"]))
    assert ran == ["distill", "validate", "export"]


def test_pipeline_rejects_unknown_stage(tmp_path):
    with pytest.raises(ConfigError, match="stages"):
        pipeline.run(_cfg(tmp_path, ["stages=[generate,train]"]))


def test_a_stage_thread_setting_does_not_leak_into_the_next(tmp_path, monkeypatch):
    """generate's threads=auto sets 1 thread in-process; distill after it must get the cores back
    (it ran on 1 of 2 cores in the pipeline before this)."""
    import torch

    from specdistill.distill.pipeline.plan import Step

    seen = []

    def run(cfg):
        seen.append(torch.get_num_threads())
        torch.set_num_threads(1)  # what generate's threads=auto does
        (tmp_path / cfg.name).mkdir()
        (tmp_path / cfg.name / "result.json").write_text("{}")

    monkeypatch.setattr(execute, "_stage_runner", lambda name: run)
    own = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for name in ("generate", "distill"):
            config = {"name": name, "resume": False}  # the user's own: no checkpoint lookup
            execute.run_step(
                Step(name, name, "m", str(tmp_path / name), "result.json", config=config)
            )
        assert seen == [2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(own)


LONG_LEG = [
    "long_context.enabled=true",
    "++long_context.generate.dataset.buckets=[0-512]",
    "++long_context.generate.dataset.per_bucket=4",
    "++long_context.generate.dataset.max_tokens=400",  # the toy target's context is 512
    "++long_context.generate.max_new_tokens=16",
    "long_context.distill.max_steps=2",
    "long_context.distill.eval_every=2",
    "long_context.distill.save_every=2",
    "++long_context.validate.dataset.buckets=[0-512]",
    "++long_context.validate.dataset.per_bucket=2",
    "++long_context.validate.dataset.max_tokens=400",
]


def test_long_context_leg_end_to_end(tmp_path, monkeypatch):
    """`long_context.enabled=true` on the tiny toy world (the long-context leg, its buckets cut to
    the toy target's context): long Seq-KD rows, the distilled drafter fine-tuned on them, three
    drafters validated by bucket, each lossless; summary.md sets them side by side; a rerun
    runs nothing."""
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, ["stages=[generate,distill,validate]", "validate_base=false", *LONG_LEG])
    result = pipeline.run(cfg)
    long_names = ["generate_long", "distill_long", "validate_long_base", "validate_long_short",
                  "validate_long"]  # fmt: skip
    assert set(result.stages) == {"generate", "distill", "validate", *long_names}
    gen = result.stages["generate_long"]
    assert gen["samples"] == 4 and gen["skipped_long_prompts"] == 0
    tuned = result.stages["distill_long"]
    assert tuned["steps"] == 2 and tuned["final_path"] == str(run_dir / "distill_long" / "final")
    drafters = {}
    for name in long_names[2:]:
        r = read_json(run_dir / name / "report.json")
        assert r["lossless"] is True and list(r["modes"]) == ["greedy"], name
        assert [b["bucket"] for b in r["buckets"]] == ["0-512"] and r["prompts"] == 2
        drafters[name] = r["config"]["pair"]["drafter"]
    assert drafters == {"validate_long_base": None,
                        "validate_long_short": str(run_dir / "distill" / "best"),
                        "validate_long": tuned["final_path"]}  # fmt: skip
    text = (run_dir / "summary.md").read_text()
    assert "## Long contexts (`long_context`)" in text
    assert "base / short-trained / long-trained drafter" in text
    assert next(line for line in text.splitlines() if line.startswith("| 0-512 | 2 ("))

    def boom(stage):
        raise AssertionError(f"{stage} ran again")

    monkeypatch.setattr(execute, "_stage_runner", boom)
    assert pipeline.run(cfg).stages["distill_long"] == tuned
