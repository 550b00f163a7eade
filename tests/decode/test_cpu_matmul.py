"""Few-row linears as weight @ x.T (decode.cpu_matmul): same values, scoped, wired into verify."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from specdistill.data.runtime import ConfigError
from specdistill.decode import cpu_matmul
from specdistill.decode.cpu_matmul import MAX_ROWS, few_row_linear, weight_major_linear
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import greedy_reference, prompts


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 5), (3, 4), (2, 8), (1, 16), (1, 17), (40,)])
def test_few_row_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 24, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(*shape, 24, generator=g)
    got, want = few_row_linear(x, w, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = x.numel() // 24
    if not 2 <= rows <= MAX_ROWS:  # outside the few-row range it is F.linear itself
        assert torch.equal(got, want)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_over_a_tall_narrow_weight_takes_two_columns(monkeypatch, bias):
    """A 1-row input over a weight of >= ONE_ROW_MIN elements and <= ONE_ROW_MAX_IN inputs (an
    LM head over a small hidden size) goes as a 2-column product: the same values as F.linear;
    a wide weight of the same size, and a small one, keep F.linear itself."""
    monkeypatch.setattr(cpu_matmul, "ONE_ROW_MIN", 48 * 24)
    monkeypatch.setattr(cpu_matmul, "ONE_ROW_MAX_IN", 24)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 24, generator=g)
    w, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g) if bias else None
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, c: calls.append(c.shape) or real_mm(a, c))
    got = few_row_linear(x, w, b)
    assert calls == [(24, 2)] and got.shape == (1, 1, 48) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    calls.clear()
    wide = torch.randn(24, 48, generator=g)  # same size, 48 inputs > ONE_ROW_MAX_IN
    xw = torch.randn(1, 48, generator=g)
    assert torch.equal(few_row_linear(xw, wide, None), F.linear(xw, wide)) and calls == []
    small = w[:40]  # below ONE_ROW_MIN
    assert torch.equal(few_row_linear(x, small, None), F.linear(x, small)) and calls == []


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(48, 24), (24, 48), (7, 5)])
def test_one_row_over_every_weight_takes_two_columns_where_the_layout_says(
    monkeypatch, shape, bias
):
    """`one_row_all`: a 1-row input over any weight (small, wide: none of them tall and narrow)
    goes as the 2-column product, with F.linear's values to rounding; without it, or with more
    rows than one, the 1-row path is not taken."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(1, 1, shape[1], generator=g)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, c: calls.append(tuple(c.shape)) or real_mm(a, c))
    got = few_row_linear(x, w, b, cpu_matmul.TWO_COLUMN)
    assert calls == [(shape[1], 2)] and got.shape == (1, 1, shape[0]) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    calls.clear()
    assert torch.equal(few_row_linear(x, w, b, cpu_matmul.WEIGHT_MAJOR), F.linear(x, w, b))
    assert calls == []
    x3 = torch.randn(1, 3, shape[1], generator=g)  # 3 rows: the weight-major product, 3 columns
    torch.testing.assert_close(
        few_row_linear(x3, w, b, cpu_matmul.TWO_COLUMN), F.linear(x3, w, b), rtol=1e-5, atol=1e-5
    )
    assert calls == [(shape[1], 3)]


def test_switch_is_scoped_and_restored_on_error():
    original = torch.nn.Linear.forward
    with weight_major_linear(False):
        assert torch.nn.Linear.forward is original
    with pytest.raises(RuntimeError, match="boom"), weight_major_linear():
        assert torch.nn.Linear.forward is not original
        raise RuntimeError("boom")
    assert torch.nn.Linear.forward is original


def count_calls(monkeypatch, delay: float = 0.0, path: str = "few_row_linear") -> dict[int, int]:
    """Rows of every input the few-row path `path` of decode.cpu_matmul (`few_row_linear`, or
    `packed_linear`) saw, counted; each call `delay` s slower (a machine where that path is the
    slow one)."""
    seen: dict[int, int] = {}
    real = getattr(cpu_matmul, path)

    def spy(*args):
        x = next(a for a in args if isinstance(a, torch.Tensor))  # packed_linear: (module, x)
        rows = x.numel() // x.shape[-1]
        seen[rows] = seen.get(rows, 0) + 1
        if delay:
            time.sleep(delay)
        return real(*args)

    monkeypatch.setattr(cpu_matmul, path, spy)
    return seen


@pytest.mark.parametrize("setting", ["weight_major", "weight_major-tall-head", "linear"])
def test_verify_steps_take_the_few_row_path_only_when_asked(monkeypatch, setting):
    """weight_major on CPU: the (gamma+1)-token verify goes through few_row_linear, the prefill never
    does, 1-token steps only for a model with a tall, narrow weight (here the tiny models' [64,
    32] heads, thresholds lowered to qualify them); linear: nothing does. Output stays the
    target's greedy output."""
    if setting == "weight_major-tall-head":
        monkeypatch.setattr(cpu_matmul, "ONE_ROW_MIN", 64 * 32)
        monkeypatch.setattr(cpu_matmul, "ONE_ROW_MAX_IN", 32)
    target = tiny_llama(vocab=64, layers=2, seed=0)
    drafter = tiny_llama(vocab=64, layers=1, seed=1)
    assert target.lm_head.weight.shape == (64, 32)
    original = torch.nn.Linear.forward
    seen = count_calls(monkeypatch)
    dec = SpeculativeDecoder(
        target,
        drafter,
        DecoderConfig(gamma=4, max_new_tokens=24, cpu_matmul=setting.removesuffix("-tall-head")),
    )
    prompt = prompts(2, 64, seed=3)[1]  # 12 tokens: its prefill is 11 rows
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 24)
    if setting == "linear":
        assert seen == {}
    else:
        assert seen.get(5, 0) > 0  # verify steps: gamma + 1 rows
        assert max(seen) < len(prompt)  # never the prefill
        if setting == "weight_major":
            assert all(rows >= 2 for rows in seen)  # no tall weight: 1-row steps stay plain
        else:
            assert seen.get(1, 0) > 0  # 1-token steps reach the 2-column path
    assert torch.nn.Linear.forward is original  # restored after every step


def test_bad_cpu_matmul_setting_names_the_field():
    model = tiny_llama(vocab=64, layers=1)
    with pytest.raises(ConfigError, match=r"decoder\.cpu_matmul='fast'"):
        SpeculativeDecoder(model, model, DecoderConfig(cpu_matmul="fast"))
