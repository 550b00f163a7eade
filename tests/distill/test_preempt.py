"""Preemptible distill (distill/train/preempt.py, train/progress.py): a stop signal saves the
step it arrives in and exits 128 + signal; a rerun of the same command resumes there without a
flag (`resume: auto`) and ends with the weights of an uninterrupted run; a checkpoint of another
config is one error line; the pipeline starts a changed distill step afresh."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specdistill.data.runtime import ConfigError
from specdistill.distill.pipeline.execute import distill_resume
from specdistill.distill.train import stage as train
from specdistill.distill.train.preempt import StopRequest
from specdistill.distill.train.progress import config_changes, resume_point, run_config
from specdistill.distill.train.settings import TrainSettings
from tests.distill.test_deepspeed import COMMON, _torchrun

STEPS = ["max_steps=6", "save_every=100", "eval_every=3"]  # checkpoints: signals and the last


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:  # same process layout, same data, same RNG: bit-identical
        assert torch.equal(wa[k], wb[k]), k


def _checkpoint(out: Path, step: int, config: dict) -> None:
    """A checkpoint folder as save_checkpoint leaves it, state file only."""
    root = out / "checkpoints"
    (root / f"step-{step:08d}").mkdir(parents=True)
    state = {"step": step, "config": config}
    (root / f"step-{step:08d}" / "trainer_state.json").write_text(json.dumps(state))
    (root / "latest").write_text(f"step-{step:08d}\n")


def test_run_config_flattens_and_drops_run_only_keys():
    cfg = OmegaConf.create(
        {"a": 1, "b": {"c": [1, 2], "d": {}}, "resume": "auto", "logger": {"x": 1}, "e": "${a}"}
    )
    assert run_config(cfg) == {"a": 1, "b.c": [1, 2], "b.d": {}, "e": 1}
    saved = json.loads(json.dumps(run_config(cfg)))  # what trainer_state.json gives back
    assert config_changes(saved, run_config(cfg)) == []
    assert config_changes(saved, {**saved, "a": 2, "f": 0}) == ["a: 1 -> 2", "f: None -> 0"]


def test_resume_point_by_mode(distill_cfg, tmp_path):
    cfg = distill_cfg(tmp_path / "run")
    config = run_config(cfg)
    s = TrainSettings.from_cfg(cfg)
    assert s.resume == "auto" and resume_point(config, s) is None  # nothing to resume
    _checkpoint(tmp_path / "run", 4, config)
    assert resume_point(config, s).name == "step-00000004"  # the same config: continue
    other = distill_cfg(tmp_path / "run", "lmbda=0.25")
    with pytest.raises(ConfigError) as err:  # another config: refused before anything loads
        resume_point(run_config(other), TrainSettings.from_cfg(other))
    msg = str(err.value)
    assert "lmbda: 0.0 -> 0.25" in msg and "resume=true" in msg and "\n" not in msg
    forced = distill_cfg(tmp_path / "run", "lmbda=0.25", "resume=true")
    assert resume_point(run_config(forced), TrainSettings.from_cfg(forced)) is not None
    fresh = distill_cfg(tmp_path / "run", "resume=false")
    assert resume_point(run_config(fresh), TrainSettings.from_cfg(fresh)) is None
    with pytest.raises(ConfigError, match=r"^resume='sometimes': use auto, true or false"):
        TrainSettings.from_cfg(distill_cfg(tmp_path / "run", "resume=sometimes"))


def test_pipeline_resumes_only_its_own_step(tmp_path):
    """The same step (fingerprint) continues; a step whose config or inputs changed starts
    afresh over the old checkpoints; a user's explicit resume is left alone."""
    out = tmp_path / "distill"

    def cfg(resume="auto"):
        return OmegaConf.create({"output_dir": str(out), "resume": resume})

    c = cfg()
    distill_resume(c, "aaaa", str(out))  # no checkpoint yet
    assert (c.run_key, c.resume) == ("aaaa", "auto")
    _checkpoint(out, 2, {"run_key": "aaaa"})
    c = cfg()
    distill_resume(c, "aaaa", str(out))
    assert c.resume == "auto"
    c = cfg()
    distill_resume(c, "bbbb", str(out))
    assert (c.run_key, c.resume) == ("bbbb", False)
    c = cfg(True)
    distill_resume(c, "bbbb", str(out))
    assert c.resume is True


def test_a_handler_installed_before_is_called_after_the_save():
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda sig, frame: seen.append(sig))
    try:
        stop = StopRequest().install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.signum == signal.SIGUSR2 and seen == []  # only remembered
        with pytest.raises(SystemExit) as e:
            stop.exit(stop.signum)
        assert e.value.code == 128 + signal.SIGUSR2 and seen == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # ours removed
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.mark.slow  # three short toy-tiny runs in process
def test_sigterm_saves_that_step_and_the_rerun_ends_like_an_uninterrupted_run(
    distill_cfg, tmp_path, seqkd_dir, monkeypatch
):
    common = (f"data.path={seqkd_dir}", *STEPS, "lmbda=0.5", "onpolicy.max_new_tokens=8")
    ref = train.run(distill_cfg(tmp_path / "ref", *common))

    def term_after_3(step: int) -> None:
        if step == 3:  # arrives after step 3's save check: step 4 is the one saved
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train, "STEP_HOOK", term_after_3)
    with pytest.raises(SystemExit) as e:
        train.run(distill_cfg(tmp_path / "run", *common))
    assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert not (run / "result.json").exists() and not (run / "final").exists()
    monkeypatch.setattr(train, "STEP_HOOK", None)
    res = train.run(distill_cfg(run, *common))  # the same command: no resume flag
    assert [h["step"] for h in res.history] == [1, 2, 3, 4, 5, 6]
    assert [h["loss"] for h in res.history] == [h["loss"] for h in ref.history]
    _same_weights(tmp_path / "ref" / "final", run / "final")
    assert res.alpha_after == ref.alpha_after


MARKER_SCRIPT = Path(__file__).with_name("step_marker.py")
LAST = 12  # steps of the preempted run


def _launch(tmp: Path, out: Path, step_file: Path) -> subprocess.Popen:
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", str(MARKER_SCRIPT)]
    cmd += [*COMMON, f"max_steps={LAST}", "save_every=100", f"output_dir={out}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "SPECDISTILL_TEST_STEP_FILE": str(step_file), "SPECDISTILL_TEST_STEP_PAUSE": "0.3"}  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _steps_done(step_file: Path) -> int:
    text = step_file.read_text().strip() if step_file.exists() else ""
    return int(text) if text else 0


@pytest.mark.slow  # an uninterrupted 2-process run and up to four more
def test_two_processes_sigtermed_at_random_moments_end_with_the_uninterrupted_weights(tmp_path):
    """SIGTERM to torchrun (which passes it to both ranks) at a seeded random moment after each
    run has trained a new step, three times, each followed by the same command; the fourth run
    finishes. Only the last step and the signals save, so each interrupted run must have saved
    the step both ranks agreed on, later than the one it resumed from."""
    ref = tmp_path / "ref"
    proc = _torchrun(tmp_path, ref, f"max_steps={LAST}", "save_every=100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, marks, rng = tmp_path / "run", tmp_path / "steps", random.Random(0)
    saved = [0]
    for _ in range(3):
        p = _launch(tmp_path, out, marks)
        deadline = time.monotonic() + 240
        while _steps_done(marks) <= saved[-1] and p.poll() is None:
            assert time.monotonic() < deadline, "no step trained in 240 s"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # mid-step, mid-eval, mid-save or between steps
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
        if (out / "result.json").exists():  # it had reached the last step: the run is done
            break
        assert p.returncode != 0  # torchrun reports the signal it was sent
        latest = (out / "checkpoints" / "latest").read_text().strip()
        step = int(latest.split("-")[1])
        assert saved[-1] < step < LAST, (saved, latest, err[-2000:])
        saved.append(step)
    assert len(saved) > 1, saved  # at least one signal-driven save
    p = _launch(tmp_path, out, marks)  # the same command once more: resumes and finishes
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["history"][-1]["step"] == LAST
    assert [h["step"] for h in result["history"]] == list(range(1, LAST + 1))
    _same_weights(ref / "final", out / "final")
