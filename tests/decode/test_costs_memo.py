"""Measured draft costs shared between decoders (decode/draft_length/costs_memo.py).

p = target, q = drafter. A run's decoders over the same models share the forwards a cost
measurement times whatever their serving mode, and the whole measurement where only what a
round drafts differs; anything that changes a timed forward (another drafter, max_draft, the
prompt) is measured again.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.decode.draft_length import measure
from specdistill.decode.draft_length.costs_memo import CostsMemo
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import prompts, truncated_copy

TARGET = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
DRAFTER = truncated_copy(TARGET)
PROMPT = torch.tensor([prompts(1, 40, seed=3)[0]])
T1 = Sampling(temperature=1.0)


def _dec(memo, drafter=DRAFTER, **kw) -> SpeculativeDecoder:
    cfg = DecoderConfig(
        **({"max_new_tokens": 8, "draft_length": "confidence", "max_draft": 3} | kw)
    )
    return SpeculativeDecoder(TARGET, drafter, cfg, costs_memo=memo)


@pytest.fixture
def counted(monkeypatch):
    """Counts of the forward timings and glue measurements taken (the glue is fixed per mode,
    so two measurements of one mode give equal costs)."""
    calls = {"forwards": 0, "glue": 0}
    timed = measure.time_forwards

    def forwards(*a, **k):
        calls["forwards"] += 1
        return timed(*a, **k)

    def glue(dec, ids, ks, step):
        calls["glue"] += 1
        return dict.fromkeys(ks, 0.02 if dec.cfg.sampling.greedy else 0.09)

    monkeypatch.setattr(measure, "time_forwards", forwards)
    monkeypatch.setattr(measure, "round_glue", glue)
    return calls


def test_the_other_serving_mode_reuses_the_forwards_and_times_its_own_glue(counted):
    memo = CostsMemo()
    greedy = _dec(memo).draft_costs(PROMPT)
    sampled = _dec(memo, sampling=T1).draft_costs(PROMPT)
    assert counted == {"forwards": 1, "glue": 2}
    assert memo.forward_hits == 1 and memo.cost_hits == 0
    # the same timed forwards: c and every verify width agree, the glue is the mode's own
    assert sampled.c == greedy.c and sampled.verify_tokens == greedy.verify_tokens
    assert sampled.round_overhead == pytest.approx(greedy.round_overhead + 0.07)


def test_decoders_that_differ_in_what_a_round_drafts_share_the_whole_measurement(counted):
    memo = CostsMemo()
    first = _dec(memo, gamma=4).draft_costs(PROMPT)
    for kw in ({"gamma": 1}, {"draft_length": "heuristic"}, {"draft_floor": False},
               {"max_new_tokens": 32}, {"lookup": True}):  # fmt: skip
        assert _dec(memo, **kw).draft_costs(PROMPT) == first, kw
    assert counted == {"forwards": 1, "glue": 1} and memo.cost_hits == 5


@pytest.mark.parametrize(
    "other",
    [
        {"max_draft": 4},  # more verify widths timed
        {"verify_costs": "linear"},
        {"lean_steps": False},  # the steps run through another path
        {"drafter": truncated_copy(TARGET)},  # another model, even with equal weights
        {"prompt": torch.tensor([prompts(1, 40, seed=4)[0]])},
    ],
)
def test_anything_a_timed_forward_sees_is_measured_again(counted, other):
    memo = CostsMemo()
    _dec(memo).draft_costs(PROMPT)
    other = dict(other)
    prompt = other.pop("prompt", PROMPT)
    _dec(memo, **other).draft_costs(prompt)
    assert counted == {"forwards": 2, "glue": 2} and memo.forward_hits == memo.cost_hits == 0


def test_without_a_memo_each_decoder_measures_its_own(counted):
    _dec(None).draft_costs(PROMPT)
    _dec(None).draft_costs(PROMPT)
    assert counted == {"forwards": 2, "glue": 2}
