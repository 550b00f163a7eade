"""Bad input fails before decoding with an error naming the field; the validate CLI contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def models():
    return tiny_llama(vocab=64, layers=1, seed=0), tiny_llama(vocab=64, layers=1, seed=1)


@pytest.mark.parametrize(
    "cfg,field",
    [
        (DecoderConfig(gamma=0), "decoder.gamma"),
        (DecoderConfig(gamma=-2), "decoder.gamma"),
        (DecoderConfig(max_new_tokens=0), "max_new_tokens"),
        (DecoderConfig(sampling=Sampling(temperature=-0.5)), "decoder.sampling.temperature"),
        (DecoderConfig(sampling=Sampling(temperature=1.0, top_p=0.0)), "decoder.sampling.top_p"),
        (DecoderConfig(sampling=Sampling(temperature=1.0, top_p=1.5)), "decoder.sampling.top_p"),
        (DecoderConfig(sampling=Sampling(temperature=1.0, top_k=-1)), "decoder.sampling.top_k"),
        (DecoderConfig(lenience=0.0), "decoder.lenience"),
        (DecoderConfig(cache="paged"), "decoder.cache"),
    ],
)
def test_bad_decoder_settings_name_the_field(models, cfg, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SpeculativeDecoder(*models, cfg)


def test_mismatched_vocab(models):
    target, _ = models
    other = tiny_llama(vocab=48, layers=1)
    with pytest.raises(ConfigError, match="vocab sizes differ"):
        SpeculativeDecoder(target, other, DecoderConfig())
    with pytest.raises(ConfigError, match=r"pair\.drafter"):  # tokenizer covers more than q has
        SpeculativeDecoder(target, other, DecoderConfig(), tokenizer_len=60)
    # smaller only by padding: fine
    SpeculativeDecoder(target, other, DecoderConfig(), tokenizer_len=40)


def test_drafter_on_other_dtype_or_device(models):
    target, _ = models
    with pytest.raises(ConfigError, match=r"pair\.drafter has dtype torch\.float64"):
        SpeculativeDecoder(target, tiny_llama(vocab=64, layers=1).double(), DecoderConfig())
    with pytest.raises(ConfigError, match=r"pair\.drafter is on meta"):
        SpeculativeDecoder(target, tiny_llama(vocab=64, layers=1).to("meta"), DecoderConfig())


def test_bad_prompts(models):
    dec = SpeculativeDecoder(*models, DecoderConfig(max_new_tokens=2))
    with pytest.raises(ConfigError, match="left-padded"):
        ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
        dec.generate(ids, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ConfigError, match="empty prompt"):
        dec.generate(torch.zeros((1, 0), dtype=torch.long))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="1")
    return subprocess.run(
        [sys.executable, "-m", "specdistill.decode.validate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


REQUIRED = ("lossless", "alpha", "tau", "gamma", "c", "speedup", "theoretical_speedup")
REQUIRED += ("decoder_efficiency", "device", "acceptance_by_position", "recommended_k", "machine")


def test_cli_small_run_writes_report(tmp_path, toy_tiny):
    out = tmp_path / "val"
    r = _cli(
        "pair=toy-tiny",
        f"output_dir={out}",
        "num_prompts=2",
        "max_new_tokens=12",
        "repeats=1",
        "step_time_iters=3",
        "decoder.gamma=3",
        f"pair.drafter={toy_tiny.drafter_dir}",  # how the pipeline passes a distilled drafter
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    for key in REQUIRED:
        assert key in report, key
    assert report["lossless"] is True and report["device"] == "cpu"
    assert report["gamma"] == 3 and len(report["acceptance_by_position"]) == 3
    assert report["hf_assisted"]["same_tokens"] is True
    assert report["alpha_sampled"] is not None
    assert report["drafter"] == str(toy_tiny.drafter_dir)
    md = (out / "report.md").read_text()
    assert md.count("|") > 20 and md.index("tau at K=3, greedy") < md.index("speedup (measured)")
    assert report["machine"] and report["machine"] in md  # speed figures name their machine
    # the CLI's one line leads with acceptance, then this machine's speed
    assert r.stdout.strip().splitlines()[-1].startswith(f"tau {report['tau']} at K=3")


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, toy_tiny):
    r = _cli("pair=toy-tiny", f"output_dir={tmp_path}", "decoder.gamma=0")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: decoder.gamma=0")
    r = _cli("pair=toy-tiny", f"output_dir={tmp_path}", "pair.drafter=/nonexistent/ckpt")
    assert r.returncode == 2 and "pair.drafter" in r.stderr


def test_sampling_decoder_in_process(tmp_path, toy_tiny):
    """`decoder=sampling`: lossless is distributional (None here), alpha is the sampled alpha."""
    from hydra import compose, initialize_config_module

    from specdistill.decode.validate.stage import run

    overrides = ["pair=toy-tiny", "decoder=sampling", f"output_dir={tmp_path}", "num_prompts=2"]
    overrides += ["max_new_tokens=8", "repeats=1", "hf_assisted=false", "step_time_iters=2"]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="validate", overrides=overrides)
    r = run(cfg)
    assert r.temperature == 1.0 and r.lossless is None and r.alpha_sampled == r.alpha
    assert 0.0 <= r.alpha <= 1.0 and 1.0 <= r.tau <= r.gamma + 1
    assert json.loads((tmp_path / "report.json").read_text())["hf_assisted"] is None


@pytest.mark.slow
def test_cli_interface_line(tmp_path, toy_tiny):
    """The exact command the project's checks run (default settings, toy-tiny)."""
    r = _cli("pair=toy-tiny", f"output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(key in report for key in REQUIRED)
    assert report["lossless"] is True
