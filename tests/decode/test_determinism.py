"""The figures of record are a function of models, prompts, config and seed: validate run twice
under different thread counts decodes the same tokens and prints the same acceptance figures
(no timing, CPU feature or thread count may choose a kernel, a round or a length)."""

from __future__ import annotations

from pathlib import Path

import torch

import specdistill.decode
from specdistill.decode.config import DecoderSettings
from specdistill.decode.validate.stage import run

# what validate reports that must not move with the machine (speed figures may)
ACCEPTANCE_KEYS = (
    "alpha",
    "drafter_alpha",
    "tau",
    "acceptance_by_position",
    "accepted_at",
    "trials_at",
)


def _cfg(tmp_path, threads: int, *extra: str):
    from hydra import compose, initialize_config_module

    overrides = ["pair=toy-tiny", f"output_dir={tmp_path}", "num_prompts=4", "max_new_tokens=24"]
    overrides += ["hf_assisted=false", "step_time_iters=2", "plot=false", "progress=false"]
    overrides += [f"threads={threads}", *extra]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="validate", overrides=overrides)


def test_default_decoder_has_no_timed_choice():
    """The stages' default decoder drafts gamma every round, no prompt lookup (fails if a
    timed or adaptive policy, or lookup, becomes the default)."""
    d = DecoderSettings()
    assert (d.draft_length, d.lookup, d.gamma) == ("fixed", False, 4)


def test_the_decoder_reads_no_clock():
    """No module of the decoder (validate's and the bench's timing aside, and `llamacpp/`, which
    manages another engine's process and build, never our rounds) reads a clock or a CPU
    feature, so nothing a machine measures can change a kernel, a round or a draft length."""
    root = Path(specdistill.decode.__file__).parent
    apart = {"validate", "bench", "llamacpp"}
    sources = [p for p in root.rglob("*.py") if not apart & set(p.parts)]
    assert len(sources) > 15
    for path in sources:
        text = path.read_text()
        for needle in (
            "perf_counter",
            "time.time",
            "import time",
            "cpuinfo",
            "mkldnn",
            "cpu_capability",
        ):
            assert needle not in text, (path.name, needle)


def test_validate_figures_equal_across_thread_counts(tmp_path, toy_tiny):
    before = torch.get_num_threads()
    try:
        one = run(_cfg(tmp_path / "t1", 1))
        two = run(_cfg(tmp_path / "t2", 2))
    finally:
        torch.set_num_threads(before)
    assert one.modes.keys() == two.modes.keys() == {"greedy", "sampling"}
    for mode in one.modes:
        for key in ACCEPTANCE_KEYS:
            assert one.modes[mode][key] == two.modes[mode][key], (mode, key)
    assert one.modes["greedy"]["trials_at"][0] > 0  # the drafter drafted: figures measured
    assert one.lossless is two.lossless is True
    assert one.acceptance_by_position == two.acceptance_by_position
    assert (
        one.recommended_k["acceptance_by_position"] == two.recommended_k["acceptance_by_position"]
    )
