"""Few-row linears through oneDNN's prepacked weights (decode.cpu_matmul `packed_linear`, the
`packed_from` of a Layout): same values as F.linear, never stale, chosen by timing only from the
width where it is faster, wired into verify steps and never into prefill."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from specdistill.decode import cpu_matmul, matmul_choice
from specdistill.decode.cpu_matmul import LINEAR, MAX_ROWS, PACKED, Layout, packed_available
from specdistill.decode.matmul_choice import MARGIN, decide
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.decode.test_cpu_matmul import count_calls
from tests.decode.test_matmul_choice import tiny_pair
from tests.decode.test_speculative import greedy_reference, prompts

pytestmark = pytest.mark.skipif(
    not packed_available(), reason="this torch build has no oneDNN (mkldnn) linear"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2,), (1, 4), (3, 5), (1, 16)])
def test_packed_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 48, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 24, generator=g))
    x = torch.randn(*shape, 24, generator=g)
    got = cpu_matmul.packed_linear(lin, x)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_in_place_weight_updates():
    """Online adaptation trains a drafter between decodes: the reordered copy must follow the
    weight, or the decode would read a stale drafter."""
    lin = torch.nn.Linear(16, 32, bias=False)
    x = torch.randn(3, 16)
    first = cpu_matmul.packed_linear(lin, x)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    second = cpu_matmul.packed_linear(lin, x)
    torch.testing.assert_close(second, 2.0 * first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    cpu_matmul.drop_packed(lin)
    assert lin not in cpu_matmul._PACKED


def test_layout_packs_only_its_rows():
    lay = Layout(packed_from=4)
    assert [r for r in range(0, MAX_ROWS + 3) if lay.packs(r)] == list(range(4, MAX_ROWS + 1))
    assert not any(LINEAR.packs(r) for r in range(MAX_ROWS + 2)) and not LINEAR.any
    assert PACKED.packs(2) and not PACKED.packs(1) and PACKED.any
    assert lay.switches(5) and not lay.switches(3) and Layout(few_rows=True).switches(3)


def test_layouts_in_words():
    assert LINEAR.describe() == "F.linear"
    assert cpu_matmul.WEIGHT_MAJOR.describe() == (
        "W @ x.T for 2-16 rows; 1 row over a tall, narrow weight as 2 columns; F.linear otherwise"
    )
    assert PACKED.describe() == "oneDNN prepacked for 2-16 rows; F.linear otherwise"
    assert Layout(few_rows=True, packed_from=4).describe() == (
        "W @ x.T for 2-3 rows; oneDNN prepacked for 4-16 rows; F.linear otherwise"
    )
    assert Layout(few_rows=True, packed_from=2).describe() == PACKED.describe()


def _times(**per_layout: dict[int, float]):
    return {(name, w): t for name, ts in per_layout.items() for w, t in ts.items()}


@pytest.mark.parametrize(
    "times, want",
    [
        # the Xeon's shape: F.linear jumps at 4 rows, the prepacked path stays flat
        (
            _times(
                linear={2: 1.05, 3: 1.1, 4: 1.6, 9: 2.1},
                weight_major={2: 2.2, 3: 2.2, 4: 2.2, 9: 2.2},
                packed={2: 1.25, 3: 1.28, 4: 1.31, 9: 1.5},
            ),
            Layout(packed_from=4),
        ),
        # faster everywhere: from the narrowest width
        (
            _times(linear={2: 1.0, 9: 2.0}, weight_major={2: 3, 9: 3}, packed={2: 0.5, 9: 1.0}),
            Layout(packed_from=2),
        ),
        # within the margin: no second copy of the weights for a tie
        (
            _times(
                linear={2: 1.0, 9: 2.0},
                weight_major={2: 3, 9: 3},
                packed={2: MARGIN, 9: 2 * MARGIN},
            ),
            LINEAR,
        ),
        # a win below a loss is no threshold: only the widths above the last loss
        (
            _times(
                linear={2: 1.0, 4: 1.0, 9: 2.0},
                weight_major={2: 3, 4: 3, 9: 3},
                packed={2: 0.5, 4: 1.2, 9: 1.0},
            ),
            Layout(packed_from=9),
        ),
        # weighed against weight-major where that is the few-row choice
        (
            _times(linear={2: 2.0, 9: 2.0}, weight_major={2: 1.0, 9: 1.0}, packed={2: 1.5, 9: 0.8}),
            Layout(few_rows=True, packed_from=9),
        ),
        # not timed (no oneDNN): never chosen
        (_times(linear={2: 1.0, 9: 2.0}, weight_major={2: 3, 9: 3}), LINEAR),
    ],
)
def test_decide_takes_the_prepacked_path_from_where_it_wins(times, want):
    assert decide(times, sorted({w for _, w in times}), False) == want


def test_packed_setting_runs_verify_steps_through_it_and_never_prefill(monkeypatch):
    seen = count_calls(monkeypatch, path="packed_linear")
    target, drafter = tiny_pair()
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul="packed")
    )
    assert dec.layout(target) == PACKED and dec.layout(drafter) == PACKED
    prompt = prompts(2, 64, seed=3)[1]  # 12 tokens: its prefill is 11 rows
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    assert seen.get(5, 0) > 0  # verify steps: gamma + 1 rows
    assert min(seen) >= 2 and max(seen) < len(prompt)  # never a 1-token step, never the prefill


def test_bf16_weights_never_take_the_prepacked_path():
    """oneDNN's bf16 reorder needs CPU features an AVX2-only CPU lacks (it raised there): a
    bf16 pair runs F.linear even when the packed path is asked for, and decodes."""
    assert not packed_available(torch.bfloat16) and packed_available(torch.float32)
    target, drafter = (m.to(torch.bfloat16) for m in tiny_pair())
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=8, cpu_matmul="packed")
    )
    assert dec.layout(target) == LINEAR and dec.layout(drafter) == LINEAR
    out = dec.generate(torch.tensor([prompts(2, 64, seed=3)[1]]))
    assert len(out.tokens[0]) == 8


def test_auto_takes_the_prepacked_path_where_the_others_are_slow(monkeypatch):
    """A machine where F.linear and weight-major over 2-16 rows are the slow ones: auto packs
    both models' few-row steps, the verify goes through the prepacked weights, the output stays
    the target's greedy output."""
    real_linear = F.linear

    def slow_linear(x, weight, bias=None):
        if 2 <= x.numel() // x.shape[-1] <= MAX_ROWS:
            time.sleep(0.002)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", slow_linear)
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: time.sleep(0.002) or real_mm(a, b))
    seen = count_calls(monkeypatch, path="packed_linear")
    target, drafter = tiny_pair(seed=4)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul="auto")
    )
    assert dec.layout(target).packed_from == 2 and dec.layout(drafter).packed_from == 2
    seen.clear()
    prompt = prompts(2, 64, seed=3)[1]
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    assert seen.get(5, 0) > 0


def test_auto_frees_the_copies_where_the_prepacked_path_is_slow(monkeypatch):
    """Timing reorders every linear weight once; a model whose layout does not take the path
    must not keep that second copy of its weights."""
    seen = count_calls(monkeypatch, delay=0.002, path="packed_linear")
    target, drafter = tiny_pair(seed=6)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=4, max_new_tokens=8, cpu_matmul="auto")
    )
    assert dec.layout(target).packed_from == 0 and dec.layout(drafter).packed_from == 0
    assert seen  # the timing ran the prepacked steps
    kept = [m for model in (target, drafter) for m in model.modules() if m in cpu_matmul._PACKED]
    assert kept == []
    assert matmul_choice.LAYOUTS["packed"] == PACKED
