"""The drift-relaxed agreement gate: its decisions against brute force and hand-computed cases,
its wiring into the updater, and its checkpointed state."""

from __future__ import annotations

import random

import pytest

from specdistill.distill.online.buffer import ReplayBuffer
from specdistill.distill.online.drift import DriftGate, recent_alpha, relax_gate
from specdistill.distill.online.update import Updater
from tests.distill.test_online import PROMPTS, _decode, online_cfg


def test_relax_gate_hand_cases():
    assert relax_gate(0.40, 0.88, 0.15) is True  # a shift: 0.48 below the best
    assert relax_gate(0.80, 0.88, 0.15) is False  # in-domain noise
    assert relax_gate(0.73, 0.88, 0.15) is False  # exactly at the margin: strict
    assert relax_gate(0.7299, 0.88, 0.15) is True
    assert relax_gate(0.40, 0.88, None) is False  # off: the gate never relaxes
    assert relax_gate(None, 0.88, 0.15) is False  # no trials yet
    assert relax_gate(0.40, None, 0.15) is False  # no reference yet


def test_recent_alpha_counts_whole_batches_up_to_the_span():
    served = [(3.0, 4, 2), (1.0, 4, 2), (2.0, 2, 2)]  # (alpha_sum, trials, requests)
    assert recent_alpha(served, 2) == pytest.approx(2.0 / 2)
    assert recent_alpha(served, 4) == pytest.approx(3.0 / 6)
    assert recent_alpha(served, 3) == pytest.approx(3.0 / 6)  # the straddling batch counts whole
    assert recent_alpha(served, 100) == pytest.approx(6.0 / 10)
    assert recent_alpha([], 4) is None and recent_alpha([(0.0, 0, 1)], 4) is None


def _brute_decisions(batches, update_at, span, margin):
    """Recompute every decision from the whole history: alpha of the last `span` requests
    (pooled over their trials) at each update, reference = max of the earlier such alphas."""
    decisions, history = [], []
    for i in update_at:
        reqs, a_sum, trials = 0, 0.0, 0
        for a, t, n in reversed(batches[: i + 1]):
            if reqs >= span:
                break
            reqs, a_sum, trials = reqs + n, a_sum + a, trials + t
        recent = a_sum / trials if trials else None
        ref = max(history) if history else None
        decisions.append(ref is not None and recent is not None and recent < ref - margin)
        if recent is not None:
            history.append(recent)
    return decisions


@pytest.mark.parametrize("seed", range(5))
def test_drift_gate_equals_brute_force_on_random_streams(seed):
    """Random batches (sizes, trials, alpha levels with shifts), updates every few batches: the
    incremental tracker (trimmed history, running max) decides exactly like a recomputation
    from the whole history; and a state_dict round trip mid-stream changes nothing."""
    rng = random.Random(seed)
    batches, level = [], 0.9
    for i in range(60):
        if i % 20 == 0 and i:
            level = rng.uniform(0.3, 0.8)
        trials = rng.choice([0, 5, 20, 40])
        batches.append((trials * min(1.0, max(0.0, rng.gauss(level, 0.1))), trials, 2))
    update_at = [i for i in range(60) if i % 2 == 1]
    expect = _brute_decisions(batches, update_at, 8, 0.15)
    gate, got = DriftGate(0.15, 8), []
    for i, b in enumerate(batches):
        gate.observe(*b)
        if i in update_at:
            got.append(gate.decide())
        if i == 31:  # a resume
            fresh = DriftGate(0.15, 8)
            fresh.load_state_dict(gate.state_dict())
            gate = fresh
    assert got == expect
    assert any(expect) and not all(expect)  # the streams exercise both outcomes
    assert sum(n for _, _, n in gate.served) <= 8 + 2  # bounded history


def test_shift_relaxes_and_recovery_tightens():
    """Hand-computed: two updates at 0.9, a drop to 0.5 (relaxed while 0.5 < 0.9 - 0.15),
    then recovery to 0.8 (strict again)."""
    gate = DriftGate(0.15, 4)
    decisions = []
    for alpha in (0.9, 0.9, 0.5, 0.5, 0.7, 0.8):
        gate.observe(alpha * 10, 10, 4)
        decisions.append(gate.decide())
    assert decisions == [False, False, True, True, True, False]
    assert gate.reference == pytest.approx(0.9)


def _updater(toy_tiny_pair, tmp_path, *overrides):
    import copy

    _, start, tok = toy_tiny_pair
    drafter = copy.deepcopy(start).requires_grad_(True)
    cfg = online_cfg(tmp_path, "update_steps=3", "update_batch=2", "optim.optimizer.lr=1e-2",
                     "gate_agreement=1.0", *overrides)  # fmt: skip
    return Updater(drafter, cfg, 10, start.config.vocab_size, tok.pad_token_id)


def test_relaxed_update_uses_gate_relaxed(toy_tiny_pair, tmp_path):
    """gate 1.0 skips every step of two different requests; relaxed with gate_relaxed=-1 (or
    null: no gate) every step is taken; relaxed never makes the gate stricter."""
    _, _, entries = _decode(toy_tiny_pair, PROMPTS, record="all", k=8)
    buf = ReplayBuffer(10_000)
    for e in entries:
        buf.add(e)
    strict = _updater(toy_tiny_pair, tmp_path, "gate_relaxed=-1.0")
    strict.update(buf, 0, relaxed=False)
    assert strict.gated == 3
    loose = _updater(toy_tiny_pair, tmp_path, "gate_relaxed=-1.0")
    loose.update(buf, 0, relaxed=True)
    assert loose.gated == 0 and len(loose.agreements) == 3
    off = _updater(toy_tiny_pair, tmp_path, "gate_relaxed=null")
    off.update(buf, 0, relaxed=True)
    assert off.gated == 0 and off.agreements == []  # no gate: plain steps
    never_stricter = _updater(toy_tiny_pair, tmp_path, "gate_agreement=-1.0", "gate_relaxed=1.0")
    never_stricter.update(buf, 0, relaxed=True)
    assert never_stricter.gated == 0 and len(never_stricter.agreements) == 3
