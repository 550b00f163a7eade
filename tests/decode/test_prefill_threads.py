"""`prefill_threads`: a prompt's prefill runs with its own CPU thread count, decode steps with
`threads` (data.runtime.set_threads), in the target-only run and the speculative decode alike,
and nothing leaks out of the block or out of a pipeline stage."""

from __future__ import annotations

import functools

import pytest
import torch

from specdistill.data import runtime
from specdistill.data.runtime import ConfigError, kept_threads, set_threads
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import greedy_reference, truncated_copy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_threads():
    with kept_threads():
        yield


def recording(model):
    """`model` whose forwards record (tokens fed, threads in use); the runner honours a forward
    set on the instance."""
    seen: list[tuple[int, int]] = []
    plain = model.forward

    @functools.wraps(plain)  # the forward's own signature: the runner names its cache by it
    def forward(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], torch.get_num_threads()))
        return plain(*args, **kwargs)

    model.forward = forward
    return seen


def test_thread_settings_are_checked_and_named():
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ConfigError, match=r"^prefill_threads="):
            set_threads(1, CPU, prefill=bad)
        with pytest.raises(ConfigError, match=r"^threads="):
            set_threads(bad, CPU, prefill=2)
    set_threads(1, CPU, prefill="auto")
    assert torch.get_num_threads() == 1 and runtime._prefill_threads == runtime._CORES
    set_threads(1, CPU, prefill="default")
    assert runtime._prefill_threads is None
    set_threads(1, torch.device("meta"), prefill=3)  # not a CPU: torch's threads are not ours
    assert runtime._prefill_threads is None


def test_a_prefill_block_switches_and_restores():
    set_threads(1, CPU, prefill=2)
    with runtime.prefill_threads():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), runtime.prefill_threads():
        raise RuntimeError("a failed prefill")
    assert torch.get_num_threads() == 1
    set_threads(1, CPU, prefill="default")
    with runtime.prefill_threads():
        assert torch.get_num_threads() == 1


@pytest.mark.parametrize("mode", ["baseline", "generate"])
def test_prefills_run_with_their_threads_and_steps_with_the_decode_ones(mode):
    """The target's prefill (and the drafter's) sees 2 threads, every step after it 1, and the
    tokens are the target's greedy ones (the thread count changes time, not the output)."""
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=7)
    drafter = truncated_copy(target, 1)
    cfg = DecoderConfig(gamma=3, max_new_tokens=12, lookup=False)
    prompt = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    reference = greedy_reference(target, prompt[0].tolist(), 12)
    seen = {"target": recording(target), "drafter": recording(drafter)}
    dec = SpeculativeDecoder(target, drafter, cfg)
    set_threads(1, CPU, prefill=2)
    out = getattr(dec, mode)(prompt)
    assert out.tokens[0] == reference
    fed = prompt.shape[1] - 1  # a prefill feeds all but the last prompt token
    for role in ("target", "drafter") if mode == "generate" else ("target",):
        calls = seen[role]
        assert [threads for n, threads in calls if n == fed] == [2], (role, calls)
        # steps: 1 token, a verify or a drafter's catch-up (the layout chooser's context fills,
        # decode.matmul_choice, are prefills too)
        steps = [threads for n, threads in calls if n <= cfg.gamma + 1]
        assert steps and set(steps) == {1}, (role, calls)
    assert torch.get_num_threads() == 1


def test_a_pipeline_stage_does_not_leave_its_prefill_threads(tmp_path, monkeypatch):
    from specdistill.distill.pipeline import execute
    from specdistill.distill.pipeline.plan import Step

    def run(cfg):
        set_threads(1, CPU, prefill=2)  # what validate's threads / prefill_threads do
        (tmp_path / cfg.name).mkdir()
        (tmp_path / cfg.name / "result.json").write_text("{}")

    monkeypatch.setattr(execute, "_stage_runner", lambda name: run)
    set_threads(2, CPU, prefill="default")
    execute.run_step(Step("validate", "validate", "m", str(tmp_path / "validate"), "result.json",
                          config={"name": "validate"}))  # fmt: skip
    assert torch.get_num_threads() == 2 and runtime._prefill_threads is None
