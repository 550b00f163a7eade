"""The round's host-side glue, timed in the decoder's own decodes (`draft_length.round_glue`).

p = target, q = drafter. A round's forwards are priced by the step timings; what it spends
beyond them (sampling and testing drafts, host syncs, rollbacks, bookkeeping) is its wall time
less the seconds inside `ModelRunner.forward` (`ForwardClock`). These tests add known host-side
delays to a round (a fixed one per round, one per draft) and check the measurement finds them,
and that the clock counts forwards and nothing else.
"""

from __future__ import annotations

import time

import pytest
import torch

from specdistill.decode.cache import ForwardClock, ModelRunner
from specdistill.decode.draft_length import round_glue
from specdistill.decode.drafters.autoregressive import AutoregressiveDrafter
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.verify import Verifier
from tests.conftest import tiny_llama
from tests.decode.test_speculative import prompts, truncated_copy

STEP = 0.01  # the unit: a 10 ms target step, so a delay of d seconds reads as d / STEP steps


@pytest.fixture(scope="module")
def dec():
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=0)
    return SpeculativeDecoder(target, truncated_copy(target), DecoderConfig(max_new_tokens=8))


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([prompts(1, 64, seed=4)[0]])


def test_the_clock_counts_forwards_only(dec, ids):
    runner = ModelRunner(dec.target, static=False, capacity=ids.shape[1] + 4)
    runner.forward(ids[:, :-1], prefill=True)
    assert ForwardClock.current is None
    with ForwardClock() as clock:
        t0 = time.perf_counter()
        runner.forward(ids[:, -1:], keep=1)
        time.sleep(0.02)  # host time outside the forward
        wall = time.perf_counter() - t0
    assert ForwardClock.current is None
    assert 0 < clock.seconds < wall - 0.02 + 1e-3
    before = clock.seconds
    runner.forward(ids[:, -1:], keep=1)  # no clock entered: nothing counted
    assert clock.seconds == before


def test_a_delay_per_round_reads_as_its_steps(dec, ids, monkeypatch):
    """10 ms more in each round's settle (no plain step has one) is one more 10 ms step of glue
    at every draft count; the forwards' seconds are not counted however long they take."""
    plain = round_glue(dec, ids, [1, 3], STEP, tokens=12)
    settle = Verifier.settle

    def slow(self, *args, **kwargs):
        time.sleep(STEP)
        return settle(self, *args, **kwargs)

    monkeypatch.setattr(Verifier, "settle", slow)
    slowed = round_glue(dec, ids, [1, 3], STEP, tokens=12)
    for k in (1, 3):
        assert 0.9 < slowed[k] - plain[k] < 1.6


def test_a_delay_per_draft_shows_in_the_slope(dec, ids, monkeypatch):
    """5 ms of host work per proposed draft: a 3-draft round's glue exceeds a 1-draft round's
    by two of them, one 10 ms step (a little less where a decode's last round drafts fewer)."""
    plain = round_glue(dec, ids, [1, 3], STEP, tokens=12)
    propose = AutoregressiveDrafter.propose

    def slow(self, t, pos, k, *args, **kwargs):
        time.sleep(0.5 * STEP * k)
        return propose(self, t, pos, k, *args, **kwargs)

    monkeypatch.setattr(AutoregressiveDrafter, "propose", slow)
    slowed = round_glue(dec, ids, [1, 3], STEP, tokens=12)
    slope = (slowed[3] - slowed[1]) - (plain[3] - plain[1])
    assert 0.7 < slope < 1.6
