"""`decoder.cpu_matmul=auto` (decode.matmul_choice): the layout each model's few-row linears take is
the one this machine runs faster, timed in the decoder's own steps, once per model."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from specdistill.decode import cpu_matmul, matmul_choice
from specdistill.decode.cpu_matmul import LINEAR, WEIGHT_MAJOR, Layout
from specdistill.decode.matmul_choice import MARGIN, decide
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_cpu_matmul import count_calls
from tests.decode.test_speculative import greedy_reference, prompts


def _times(
    linear: dict[int, float], weight_major: dict[int, float], two_column: float | None = None
):
    times = {("linear", w): t for w, t in linear.items()} | {
        ("weight_major", w): t for w, t in weight_major.items()
    }
    return times | ({} if two_column is None else {("two_column", 1): two_column})


@pytest.mark.parametrize(
    "linear, weight_major, widths, one_row, want",
    [
        ({2: 1.0, 9: 1.0}, {2: 0.5, 9: 0.5}, (2, 9), False, Layout(few_rows=True)),
        # within the margin: F.linear (the kernel library's own choice) keeps the tie
        ({2: 1.0, 9: 1.0}, {2: MARGIN, 9: MARGIN}, (2, 9), False, LINEAR),
        # summed over the widths: a win at 2 rows does not pay for a loss at 9
        ({2: 1.0, 9: 1.0}, {2: 0.5, 9: 1.7}, (2, 9), False, LINEAR),
        # the 1-row path is priced only for a model with a tall, narrow weight
        ({1: 1.0, 2: 1.0}, {1: 0.5, 2: 2.0}, (2,), True, Layout(one_row=True)),
        ({1: 1.0, 2: 1.0}, {1: 0.5, 2: 0.5}, (2,), False, Layout(few_rows=True)),
        ({1: 1.0, 2: 1.0}, {1: 0.5, 2: 0.5}, (2,), True, WEIGHT_MAJOR),
    ],
)
def test_decide_picks_the_faster_layout_by_width(linear, weight_major, widths, one_row, want):
    assert decide(_times(linear, weight_major), widths, one_row) == want


ALL = Layout(one_row=True, one_row_all=True)


@pytest.mark.parametrize(
    "one_row, tall, every, want",
    [
        # no tall, narrow weight: every weight's 2-column step against F.linear's alone
        (False, 0.5, 0.6, ALL),
        (False, 0.5, MARGIN, LINEAR),  # a tie keeps F.linear
        (False, 0.5, 1.3, LINEAR),
        # with one: the faster of the two 2-column choices, if it beats F.linear clearly
        (True, 0.8, 0.6, ALL),
        (True, 0.6, 0.8, Layout(one_row=True)),
        (True, 0.97, 0.97, LINEAR),
        (True, 1.2, 1.1, LINEAR),
    ],
)
def test_decide_prices_one_row_over_every_weight(one_row, tall, every, want):
    """The 1-token step: F.linear at 1.0, the tall-weight-only 2-column step at `tall` (priced
    only where the model has such a weight), every weight's at `every`; verifies tie."""
    times = _times({1: 1.0, 2: 1.0}, {1: tall, 2: 1.0}, two_column=every)
    assert decide(times, (2,), one_row) == want


def test_auto_takes_two_columns_for_one_row_where_the_gemv_is_slower(monkeypatch):
    """A machine where F.linear's 1-row GEMV is the slow kernel (each 1-row call 2 ms slower) and
    no weight is tall and narrow: auto times every model's 1-token step, takes the 2-column
    product over every weight for both models, and the target-only baseline and the speculative
    decode both run their 1-token steps through it, token-identical to the target's greedy."""
    real_linear = F.linear

    def slow_gemv(x, weight, bias=None):
        if x.numel() // x.shape[-1] == 1:
            time.sleep(0.002)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", slow_gemv)
    target, drafter = tiny_pair(seed=6)
    assert not cpu_matmul.has_two_column_weight(target)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul="auto")
    )
    assert dec.layout(target).one_row_all and dec.layout(drafter).one_row_all
    seen = count_calls(monkeypatch)
    prompt = prompts(2, 64, seed=3)[1]
    want = greedy_reference(target, prompt, 24)
    assert dec.generate(torch.tensor([prompt])).tokens[0] == want
    assert seen.get(1, 0) > 0  # the drafter's and the target's 1-token steps
    seen.clear()
    assert dec.baseline(torch.tensor([prompt])).tokens[0] == want
    assert seen.get(1, 0) >= 23 and set(seen) == {1}  # every baseline step after the prefill


def tiny_pair(seed: int = 0):
    """A 2-layer target and a 1-layer drafter over one 64-token vocabulary."""
    return tiny_llama(vocab=64, layers=2, seed=seed), tiny_llama(vocab=64, layers=1, seed=seed + 1)


def test_auto_keeps_f_linear_where_weight_major_is_slower(monkeypatch):
    """A machine where the weight-major path is slow (each call made 2 ms slower): auto times
    it, keeps F.linear for both models, and the decode never takes the path; the output stays
    the target's."""
    seen = count_calls(monkeypatch, delay=0.002)
    target, drafter = tiny_pair()
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul="auto")
    )
    assert dec.layout(target) == LINEAR and dec.layout(drafter) == LINEAR
    assert seen  # the timing ran the weight-major steps
    seen.clear()
    prompt = prompts(2, 64, seed=3)[1]
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    assert seen == {}


def test_auto_takes_weight_major_where_f_linear_is_slower(monkeypatch):
    """The mirror machine: F.linear over 2-16 rows made slow; auto picks weight-major for the
    verify (gamma + 1 rows through few_row_linear), the output stays the target's. The 2-column
    product for one row is made slow too, so the 1-row choice is the machine's, not the timing
    noise of two near-equal tiny steps (under load it could otherwise go either way)."""
    real_linear = F.linear

    def slow_linear(x, weight, bias=None):
        if 2 <= x.numel() // x.shape[-1] <= cpu_matmul.MAX_ROWS:
            time.sleep(0.002)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", slow_linear)
    seen = count_calls(monkeypatch)
    counted = cpu_matmul.few_row_linear

    def slow_one_row(x, weight, bias, layout=cpu_matmul.WEIGHT_MAJOR):
        if x.numel() // x.shape[-1] == 1 and layout.one_row_over(weight):
            time.sleep(0.002)
        return counted(x, weight, bias, layout)

    monkeypatch.setattr(cpu_matmul, "few_row_linear", slow_one_row)
    target, drafter = tiny_pair(seed=4)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul="auto")
    )
    assert dec.layout(target).few_rows and dec.layout(drafter).few_rows
    seen.clear()
    prompt = prompts(2, 64, seed=3)[1]
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    assert seen.get(5, 0) > 0 and all(rows >= 2 for rows in seen)


def test_layouts_are_timed_once_per_model_and_the_settings_skip_timing(monkeypatch):
    """Validate builds several decoders over one pair: the first times, the rest reuse its
    layouts; a new drafter is timed beside the known target, whose layout stays. `linear` and
    `weight_major` never time."""
    calls: list[set[str]] = []
    real = matmul_choice.time_layouts

    def counting(make_runner, widths, vocab, device, iters=5, reps=2, one_row=None, **kw):
        calls.append(set(make_runner))
        return real(make_runner, widths, vocab, device, iters=1, reps=1, one_row=one_row, **kw)

    monkeypatch.setattr(matmul_choice, "time_layouts", counting)
    target, drafter = tiny_pair(seed=8)
    cfg = DecoderConfig(gamma=4, max_new_tokens=8, cpu_matmul="auto")
    first = SpeculativeDecoder(target, drafter, cfg)
    chosen = first.layout(target)
    second = SpeculativeDecoder(target, drafter, cfg)
    assert second.layout(target) == chosen and second.layout(drafter) == first.layout(drafter)
    assert len(calls) == 1
    other = tiny_llama(vocab=64, layers=1, seed=11)
    third = SpeculativeDecoder(target, other, cfg)
    assert third.layout(target) == chosen and isinstance(third.layout(other), Layout)
    assert len(calls) == 2
    for setting, want in (("linear", LINEAR), ("weight_major", WEIGHT_MAJOR)):
        fixed = SpeculativeDecoder(target, drafter, DecoderConfig(cpu_matmul=setting))
        assert fixed.layout(target) == want and fixed.layout(drafter) == want
    assert len(calls) == 2


def test_weight_major_one_row_is_timed_only_over_a_tall_weight():
    """Without a tall, narrow weight a weight-major 1-token step is F.linear's again: not timed
    (start-up time, not a choice); with one, or unsaid, it is; every role keeps the 1-token
    steps `decide` reads for it."""
    target, drafter = tiny_pair(seed=12)
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=2, cpu_matmul="linear"))
    makers = {"target": partial(dec._runner, target), "drafter": partial(dec._runner, drafter)}
    widths = {"target": (1, 2, 3), "drafter": (1, 2)}
    vocab = {"target": 64, "drafter": 64}
    cpu = torch.device("cpu")
    times = matmul_choice.time_layouts(
        makers, widths, vocab, cpu, iters=1, one_row={"target": False, "drafter": True}
    )
    assert ("weight_major", 1) not in times["target"]
    assert {("linear", 1), ("two_column", 1), ("weight_major", 2)} <= set(times["target"])
    assert ("weight_major", 1) in times["drafter"]
    assert ("weight_major", 1) in matmul_choice.time_layouts(makers, widths, vocab, cpu, 1)[
        "target"
    ]
    for role, tall in (("target", False), ("drafter", True)):
        assert isinstance(decide(times[role], widths[role][1:], tall), Layout)
