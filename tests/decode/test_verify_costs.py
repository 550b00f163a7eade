"""Verify costs priced width by width (`decoder.verify_costs`, `DraftCosts.verify_tokens`).

p = target, q = drafter, k = drafts in a round. A line through the 1- and max_draft-draft
verifies misprices the widths between wherever the kernels favour some widths (on CPU a 4-row
GEMM can beat a 3-row one), so the measured costs time every width and the policies read each.
The rules themselves are checked against brute force with such costs in test_draft_length.py
(`COSTS`); here: the table's arithmetic, what it changes in a choice, how it is measured and
configured. Greedy token identity with such a table: test_draft_length.py and
test_parallel_length.py (`WIDTHS`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.config import DecoderSettings
from specdistill.decode.draft_length import DraftCosts, best_length, measure
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import prompts, truncated_copy

# 3 drafts cost less than 2 (0.35 vs 0.6 beyond the 1-draft verify's base), 5 less than 4
UNEVEN = DraftCosts(
    c=0.2,
    verify_per_token=0.3,
    round_overhead=0.0,
    parallel=True,
    draft_per_token=0.0,
    verify_tokens=(0.3, 0.6, 0.35, 0.9, 0.7),
)


def test_each_timed_width_is_read_and_the_line_goes_on_past_the_table():
    for k, extra in enumerate(UNEVEN.verify_tokens, 1):
        assert UNEVEN.verify_cost(k) == pytest.approx(1.0 + extra)
        assert UNEVEN.round_cost(k) == pytest.approx(0.2 + 1.0 + extra)
    assert UNEVEN.verify_cost(6) == pytest.approx(1.0 + 6 * 0.3)  # past the table: the line
    assert UNEVEN.round_cost(0) == 1.0  # a plain target step
    line = UNEVEN.linear()
    assert line.verify_tokens == () and line.c == UNEVEN.c and line.parallel
    assert [line.verify_cost(k) for k in (1, 2, 3)] == pytest.approx([1.3, 1.6, 1.9])


def test_a_wider_verify_that_costs_less_is_chosen_over_a_narrower_one():
    """With the drafts' acceptance known (parallel drafting), the line stops at 2 drafts, while
    the timed widths say 3 cost less than 2: verify 3 (each choice the argmax by enumeration,
    test_draft_length.py)."""
    accept = [0.6, 0.6, 0.6]
    assert best_length(accept, UNEVEN.linear()) == 2
    assert best_length(accept, UNEVEN) == 3


def _decoder(verify_costs: str, **kw) -> SpeculativeDecoder:
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    cfg = DecoderConfig(
        max_new_tokens=8, draft_length="confidence", max_draft=4, verify_costs=verify_costs, **kw
    )
    return SpeculativeDecoder(target, truncated_copy(target), cfg)


VERIFY = {1: 1.1, 2: 1.5, 3: 1.3, 4: 1.7}  # seconds of a verify of k drafts, 3 cheaper than 2


class FakeTimer:
    """Step times in seconds as a `StepTimer` would return them: a target step of 1, a drafter
    step of 0.25, the uneven verifies of VERIFY, a drafter prefill of 0.3 a call and 0.02 a
    prompt token (the 64-token prompt's 63 tokens fed, its runner's build in the 0.3)."""

    def __init__(self) -> None:
        self.role_ids = {"drafter": torch.zeros(1, 64, dtype=torch.long)}
        self.build_seconds = {"drafter": 0.1}

    def prefill_call(self, role: str, n: int, before=None) -> float:
        return 0.3 + 0.02 * n

    def target_step(self, reps: int = 4) -> float:
        return 1.0

    def draft(self, n: int) -> float:
        return 0.25

    def verify(self, k: int) -> float:
        return VERIFY[k]

    def prefill(self, role: str) -> float:  # seconds per token, as timed (its build apart)
        return (0.2 + 0.02 * 63) / 63 if role == "drafter" else 0.1


def test_measured_costs_read_each_timed_width(monkeypatch):
    """`measure_costs` with by_width: the line through 1 and 4 drafts (per token (1.7 - 1.1) / 3)
    and each width's own verify as timed; linear times only the ends and keeps the line. The
    round's glue is fixed here (timed, two decoders would each measure their own)."""
    monkeypatch.setattr(SpeculativeDecoder, "step_timer", lambda self, ids, slots=None: FakeTimer())
    monkeypatch.setattr(measure, "round_glue", lambda dec, ids, ks, step: dict.fromkeys(ks, 0.05))
    prompt = torch.tensor([prompts(1, 64, seed=2)[0]])
    costs = _decoder("by_width").draft_costs(prompt)
    assert costs.c == 0.25 and costs.verify_per_token == pytest.approx(0.2)
    assert costs.glue_per_draft == 0.0
    assert costs.prefill_per_token == pytest.approx(0.02)  # the drafter's, per target step
    assert costs.prefill_fixed == pytest.approx(0.3)  # and a call's, in target steps
    glue = costs.round_overhead - (1.1 - 1.0 - 0.2)  # the round's glue beyond the timed verify
    assert glue == pytest.approx(0.05)
    for k, seconds in VERIFY.items():
        assert costs.verify_cost(k) == pytest.approx(seconds + glue, abs=1e-4)
    line = _decoder("linear").draft_costs(prompt)
    assert line.verify_tokens == () and line.round_overhead == costs.round_overhead
    assert [line.verify_cost(k) for k in (1, 3)] == pytest.approx([1.1 + glue, 1.5 + glue])


def test_measured_costs_on_a_real_decoder_time_every_width():
    prompt = torch.tensor([prompts(1, 64, seed=2)[0]])
    costs = _decoder("by_width").draft_costs(prompt)
    assert len(costs.verify_tokens) == 4
    assert all(costs.verify_cost(k) > 0 for k in range(1, 5))
    assert _decoder("linear").draft_costs(prompt).verify_tokens == ()


def test_linear_drops_a_configured_table():
    dec = _decoder("linear", draft_costs=UNEVEN)
    assert dec.draft_costs().verify_tokens == () and dec.draft_costs().verify_per_token == 0.3
    assert _decoder("by_width", draft_costs=UNEVEN).draft_costs().verify_tokens == (
        UNEVEN.verify_tokens
    )


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"verify_costs": "table"}, "decoder.verify_costs='table': use by_width"),
        (
            {"draft_costs": {"c": 0.3, "round_overhead": 0.1, "verify_tokens": [0.1, -1.2]}},
            "decoder.draft_costs.verify_tokens=[0.1, -1.2]: each entry",
        ),
        ({"draft_costs": {"c": 0.3, "verify_tokens": 0.1}}, "decoder.draft_costs="),
    ],
)
def test_bad_verify_cost_settings_name_the_field(node, message):
    with pytest.raises(ConfigError) as err:
        DecoderSettings.from_node(node)
    assert str(err.value).startswith(message)


def test_a_reports_table_can_be_pasted_back_as_configured_costs():
    node = {"draft_costs": {"c": 0.2, "verify_per_token": 0.3, "verify_tokens": [0.3, 0.6, 0.35]}}
    s = DecoderSettings.from_node(node)
    assert s.draft_costs is not None and s.draft_costs.verify_tokens == (0.3, 0.6, 0.35)
    assert s.verify_costs == "by_width"  # the default
    assert s.decoder_config(8, ()).verify_costs == "by_width"


def test_parallel_bench_policies_take_the_linear_suffix():
    from specdistill.decode.bench.parallel import parse_policies

    assert parse_policies(["confidence", "confidence-linear"]) == [
        "confidence",
        "confidence-linear",
    ]
    with pytest.raises(ConfigError, match=r"^parallel_policies=\['confidence-rows'\]"):
        parse_policies(["confidence-rows"])


def test_a_reports_costs_map_back_to_the_same_costs():
    """What validate's report prints under `draft_figures.draft_costs` (the table included) is
    a mapping `decoder.draft_costs` and the distill stage's `eval.predict.costs` read back."""
    from specdistill.decode.draft_length import costs_from_mapping, draft_figures
    from specdistill.decode.outputs import DecodeOutput

    out = DecodeOutput(tokens=[[1, 2, 3]])
    printed = draft_figures(out, UNEVEN)["draft_costs"]
    assert printed["verify_tokens"] == list(UNEVEN.verify_tokens)
    # the drafting mode is not a cost: the decoder sets `parallel` from its own
    assert costs_from_mapping(printed) == dataclasses.replace(UNEVEN, parallel=False)
    with pytest.raises(ValueError, match="verify_tokens='0.1, 0.2' is not a list"):
        costs_from_mapping({"c": 0.2, "verify_tokens": "0.1, 0.2"})


class LineTimer:
    """A drafter prefill of `fixed` seconds a call (its runner's build included) and
    `per_token` a prompt token, as `prefill_line` reads a `StepTimer`."""

    def __init__(self, fixed: float, per_token: float, length: int, build: float) -> None:
        self.fixed, self.per_token, self.build = fixed, per_token, build
        self.role_ids = {"drafter": torch.zeros(1, length, dtype=torch.long)}
        self.build_seconds = {"drafter": build}
        self.calls: list[int] = []
        self.steps = 0  # target steps run so far
        self.steps_before: list[int] = []  # target steps run ahead of each short prefill

    def target_step(self, reps: int = 4) -> float:
        self.steps += 1
        return 0.5

    def prefill(self, role: str) -> float:
        fed = self.role_ids[role].shape[1] - 1  # the build is timed apart from the prefill
        return (self.fixed - self.build + self.per_token * fed) / fed

    def prefill_call(self, role: str, n: int, before=None) -> float:
        if before is not None:
            before()
        self.calls.append(n)
        self.steps_before.append(self.steps)
        return self.fixed + self.per_token * n


@pytest.mark.parametrize("fixed,per_token", [(0.5, 0.01), (0.0, 0.02), (2.0, 0.0)])
def test_the_drafter_s_prefill_is_a_call_s_fixed_part_and_a_part_per_token(fixed, per_token):
    """`prefill_line` recovers both parts of a prefill's cost (in target steps of 0.5 s) from
    the whole prompt's prefill and one short one, timed after `COLD_STEPS` target steps (the
    drafter's weights evicted, as a decode's first drafting round finds them); a prompt too
    short for two points prices all of it per token (the whole prompt's cost over its tokens,
    as before the split)."""
    timer = LineTimer(fixed, per_token, length=64, build=0.1)
    got_per_token, got_fixed = measure.prefill_line(timer, 0.5)
    assert timer.calls == [measure.PREFILL_SHORT]
    assert timer.steps_before == [measure.COLD_STEPS] and measure.COLD_STEPS > 0
    assert got_per_token == pytest.approx(per_token / 0.5)
    assert got_fixed == pytest.approx(fixed / 0.5)
    costs = DraftCosts(prefill_per_token=got_per_token, prefill_fixed=got_fixed)
    for n in (1, 10, 63, 500):  # a lazy prefill of n tokens, priced
        assert costs.prefill_cost(n) == pytest.approx((fixed + per_token * n) / 0.5)
    assert costs.prefill_cost(0) == 0.0  # nothing to read: nothing to pay
    short = LineTimer(fixed, per_token, length=2 * measure.PREFILL_SHORT, build=0.1)
    got_per_token, got_fixed = measure.prefill_line(short, 0.5)
    fed = 2 * measure.PREFILL_SHORT - 1
    assert short.calls == [] and got_fixed == 0.0
    assert got_per_token == pytest.approx((fixed + per_token * fed) / fed / 0.5)


def test_the_step_timer_s_short_prefill_builds_a_fresh_runner_each_time():
    """`StepTimer.prefill_call`: a lazy prefill as a decode's first drafting round pays it (a
    new runner, n tokens fed), timed, leaving the timer's own runners as they were."""
    dec = _decoder("linear")
    ids = torch.tensor([prompts(1, 64, seed=2)[0]])
    timer = dec.step_timer(ids)
    timer.draft(1)
    runner = timer.runners["drafter"][0]
    length = runner.length
    assert timer.prefill_call("drafter", 8) > 0
    assert timer.runners["drafter"][0] is runner and runner.length == length
    ran: list[int] = []  # `before` runs ahead of every rep, untimed
    assert timer.prefill_call("drafter", 8, reps=3, before=lambda: ran.append(1)) > 0
    assert len(ran) == 3
    assert timer.build_seconds["drafter"] > 0


def test_the_step_timer_times_each_prefill_per_prompt_token():
    """`StepTimer.prefill(role)`: the seconds the role's prompt prefill took (the prompt but its
    last token, as a decode feeds it) over its tokens; measured costs carry the drafter's in
    target steps."""
    dec = _decoder("linear")
    ids = torch.tensor([prompts(1, 64, seed=2)[0]])
    timer = dec.step_timer(ids)
    for role in ("target", "drafter"):
        per_token = timer.prefill(role)
        assert per_token > 0
        assert per_token == pytest.approx(timer.prefill_seconds[role] / (ids.shape[1] - 1))
    assert dec.draft_costs(ids).prefill_per_token > 0
