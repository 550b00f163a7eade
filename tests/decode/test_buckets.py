"""Validate by context-length bucket, and the decoder's cost at long context (issue 36).

p = target, q = drafter. The aggregation is checked against hand-computed figures from fake
per-batch outputs; the KV-memory formula against the real cache tensors; a validate run on
toy-tiny with `dataset=stdlib-long` writes per-bucket figures and stays lossless; and the
decoder does no per-round work that grows with the context: every target forward after the
prefill feeds at most gamma + 1 tokens whatever the prompt's length, both caches are
allocated once per decode and never re-copied (a `transformers` `DynamicLayer` concatenates
its whole history on every forward; the test shows it would fail there).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from specdistill.decode.cache import ModelRunner
from specdistill.decode.cache_layers import (
    KV_FORMULA,
    cache_nbytes,
    kv_cache_bytes,
    packed_gqa_attention,
    slot_layer,
)
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate.buckets import (
    bucket_markdown,
    bucket_mode_figures,
    bucket_prefill,
    group_batches,
    with_theory,
)
from specdistill.decode.validate.modes import TimedPass
from specdistill.decode.validate.stage import main
from tests.conftest import tiny_llama
from tests.decode.sliding_models import mistral

# ----------------------------------------------------------------------------- aggregation


def _out(
    tokens, alpha_sum=0.0, trials=0, block=0, rounds=0, pt=0.0, pd=0.0, look=(0.0, 0)
) -> DecodeOutput:
    return DecodeOutput(
        tokens=tokens,
        alpha_sum=alpha_sum,
        trials=trials,
        lookup_alpha_sum=look[0],
        lookup_trials=look[1],
        block_tokens=block,
        row_rounds=rounds,
        prefill_target_s=pt,
        prefill_drafter_s=pd,
    )


def _passes() -> list[TimedPass]:
    """Three batches of one prompt each: batches 0 and 2 are bucket A, batch 1 bucket B."""
    base = [_out([[1] * 4], pt=0.5), _out([[2] * 6], pt=2.0), _out([[3] * 4], pt=0.5)]
    spec = [
        _out([[1] * 4], alpha_sum=3.0, trials=4, block=4, rounds=2, pt=0.5, pd=0.1),
        _out([[2] * 6], alpha_sum=1.0, trials=5, block=6, rounds=5, pt=2.0, pd=0.4, look=(1.0, 2)),
        _out([[3, 3, 3, 9]], alpha_sum=1.0, trials=4, block=4, rounds=2, pt=0.5, pd=0.1),
    ]
    first = TimedPass([1.5, 5.0, 2.5], base, [1.0, 4.0, 1.4], spec)
    # the second repeat: same outputs, other seconds and prefills
    base2 = [_out(o.tokens, pt=0.3) for o in base]
    spec2 = [_out(o.tokens, pt=0.3, pd=0.1) for o in spec]
    second = TimedPass([2.0, 6.0, 2.0], base2, [1.2, 4.0, 1.2], spec2)
    return [first, second]


def test_bucket_figures_match_hand_computed_values():
    passes = _passes()
    a = bucket_mode_figures([0, 2], passes, greedy=True)
    # repeat 1: base 8 tokens / 4.0 s = 2.0, spec 8 / 2.4 = 3.333; repeat 2: 8/4.0 = 2.0,
    # 8/2.4 = 3.333 -> speedup 1.667. Decode only: base 8/(4.0-1.0)=2.667 and 8/(4.0-0.6)=2.353,
    # median 2.510; spec 8/(2.4-1.2)=6.667 and 8/(2.4-0.8)=5.0, median 5.833 -> 2.324.
    assert a["speedup"] == 1.667
    assert a["baseline_tokens_per_s"]["median"] == 2.0
    assert a["decode_speedup"] == round(((8 / 1.2 + 8 / 1.6) / 2) / ((8 / 3.0 + 8 / 3.4) / 2), 3)
    assert a["alpha"] == round((3.0 + 1.0) / 8, 4) and a["tau"] == round(8 / 4, 3)
    assert a["lossless"] is False  # batch 2's speculative row differs from target-only
    b = bucket_mode_figures([1], passes, greedy=True)
    # base 6/5.0 and 6/6.0, spec 6/4.0 twice: 1.5 / 1.1 = 1.364
    assert b["speedup"] == round(1.5 / 1.1, 3) and b["lossless"] is True
    # each repeat's own ratio: 1.5 / 1.2 and 1.5 / 1.0 (bucket A's repeats agree)
    assert b["speedup_range"] == [1.25, 1.5] and a["speedup_range"] == [1.667, 1.667]
    assert b["alpha"] == 0.2 and b["tau"] == 1.2
    # the drafter's own: bucket B's 5 tests less lookup's 2 (1 accepted) -> 0 of 3; bucket A
    # had no lookup round: its own alpha is every draft's, over all 8 tests
    assert (b["drafter_alpha"], b["drafter_trials"]) == (0.0, 3)
    assert (a["drafter_alpha"], a["drafter_trials"]) == (a["alpha"], 8)
    assert bucket_mode_figures([1], passes, greedy=False)["lossless"] is None
    # prefill: target over the 4 decodes of each repeat (0.5, 0.5, 0.5, 0.5, 0.3 x 4) / 8
    assert bucket_prefill([0, 2], passes) == {"target": 0.4, "drafter": 0.1}
    assert bucket_prefill([1], passes) == {"target": round((2.0 * 2 + 0.3 * 2) / 4, 4),
                                           "drafter": round((0.4 + 0.1) / 2, 4)}  # fmt: skip


def test_theory_uses_the_buckets_c_and_verify_cost():
    fig = with_theory({"alpha": 0.5}, gamma=2, c=0.25, verify_cost=1.5)
    # tau = 1 + 0.5 + 0.25 = 1.75; classic: 1.75 / (2 * 0.25 + 1) = 1.167; measured verify:
    # 1.75 / (0.5 + 1.5) = 0.875
    assert fig["theoretical_speedup"] == 1.167
    assert fig["theoretical_speedup_measured_verify"] == 0.875


def test_batches_never_cross_a_bucket():
    rows = [[5, 6], [7, 8, 9], [1], [2, 3, 4, 5]]
    buckets = ["A", "B", "A", "B"]
    pad = [torch.tensor([r]) for r in rows]
    singles = [(r, torch.ones_like(r)) for r in pad]
    batches, order, plan = group_batches(singles, buckets, 0, 1)  # batch 1: kept as is
    assert order == [0, 1, 2, 3] and plan.of_batch == ("A", "B", "A", "B")
    assert plan.batches_of("A") == [0, 2] and plan.tokens == {"A": [2, 1], "B": [3, 4]}
    from specdistill.data.runtime import pad_rows

    mixed = [pad_rows(rows[:2], 0), pad_rows(rows[2:], 0)]  # each batch mixes A and B
    batches, order, plan = group_batches(mixed, buckets, 0, 2)
    assert order == [0, 2, 1, 3] and plan.of_batch == ("A", "B")
    ids, mask = batches[1]
    assert [ids[j, mask[j].bool()].tolist() for j in range(2)] == [rows[1], rows[3]]
    assert group_batches(singles, [None] * 4, 0, 1) is None


# ----------------------------------------------------------------------------- KV memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", ["llama_gqa", "mistral_sliding"])
def test_kv_formula_equals_the_cache_tensors(make, dtype):
    """Dynamic (slot) layers hold exactly the tokens fed; static ones their whole capacity;
    a sliding layer keeps its whole history here (the window is a mask), so it counts fully."""
    if make == "llama_gqa":
        model = tiny_llama(vocab=64, layers=3, hidden=48, heads=6)
        model.config.num_key_value_heads = 2  # rebuild with grouped-query attention
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(model.config).eval()
    else:
        model = mistral(vocab=64, layers=2, hidden=32, window=8).eval()
    model = model.to(dtype)
    prompt = torch.randint(1, 64, (1, 40))
    for static in (False, True):
        runner = ModelRunner(model, static=static, capacity=50)
        with torch.inference_mode():
            runner.forward(prompt, keep=1, prefill=True)
            runner.forward(prompt[:, :3], keep=3)
            runner.rollback(41)
        held = sum(x.keys.nbytes + x.values.nbytes for x in runner.cache.layers)
        want = kv_cache_bytes(model.config, 50 if static else 41, dtype)
        assert held == want and want > 0
        assert cache_nbytes(runner.cache) == kv_cache_bytes(model.config, 50, dtype)
    assert "kv_heads x head_dim" in KV_FORMULA


# ----------------------------------------------------------------------------- no quadratic rework


def _instrument(model):
    """Per forward: tokens fed, the cache object, and the storage behind layer 0's keys after
    the forward. The decoder's runners call `model.forward` (no module hooks), so it is wrapped
    on the instance; `undo()` restores it."""
    seen: list[tuple[int, int, int]] = []
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        cache = kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]
        keys = cache.layers[0].keys
        seen.append((kwargs["input_ids"].shape[1], id(cache), keys.untyped_storage().data_ptr()))
        return out

    model.forward = forward

    def undo() -> None:
        del model.forward

    return seen, undo


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_work_per_round_does_not_grow_with_the_context(cache):
    """The target q = p pair accepts everything, so both decodes run the same rounds; only the
    prompt's length differs (8 vs 200 tokens): after the prefill the target is fed exactly
    gamma + 1 tokens a round in both, the drafter 1 or 2 a step, each decode builds its caches
    once, and their storage never moves (no re-copy of the history, rollbacks only move views
    or pointers)."""
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=1)
    drafter = tiny_llama(vocab=64, layers=2, hidden=32, seed=1)  # = target: all accepted
    gamma, new = 3, 17
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=gamma, max_new_tokens=new,
                                                            cache=cache))  # fmt: skip
    dec.layout(target)  # the CPU linear layouts are timed once, before any decode counted here
    fed = {}
    for plen in (8, 200):
        prompt = torch.randint(1, 64, (1, plen), generator=torch.Generator().manual_seed(plen))
        tseen, undo_t = _instrument(target)
        dseen, undo_d = _instrument(drafter)
        try:
            out = dec.generate(prompt)
        finally:
            undo_t()
            undo_d()
        assert out.accepted == out.trials > 0
        for seen in (tseen, dseen):
            assert seen[0][0] == plen - 1  # the prefill: every prompt token but the last
            assert len({s[1] for s in seen}) == 1  # one cache per model per decode
            assert len({s[2] for s in seen}) == 1  # allocated once, never re-copied
        fed[plen] = ([s[0] for s in tseen[1:]], [s[0] for s in dseen[1:]])
        assert max(fed[plen][0]) == gamma + 1 and max(fed[plen][1]) <= 2
    assert fed[8] == fed[200]


def test_a_dynamic_layer_would_fail_the_rework_check():
    """The instrument can fail: `transformers`' DynamicLayer re-copies its history into new
    storage every forward; the decoder's slot layer writes in place, growing only past its
    planned capacity (doubling, counted)."""
    from transformers.cache_utils import DynamicLayer

    layer, slot = DynamicLayer(), slot_layer(4)
    ptrs, slot_ptrs = set(), set()
    for _ in range(6):
        k = torch.randn(1, 2, 1, 8)
        layer.update(k, k)
        slot.update(k, k)
        ptrs.add(layer.keys.untyped_storage().data_ptr())
        slot_ptrs.add(slot.keys.untyped_storage().data_ptr())
    assert len(ptrs) == 6
    assert len(slot_ptrs) == 2 and slot.allocations == 2  # 4 slots, then 8
    assert slot.get_seq_length() == 6 and slot._kv[0].shape[-2] == 8
    slot.crop(-2)
    assert slot.get_seq_length() == 4 and slot.keys.untyped_storage().data_ptr() in slot_ptrs


# ----------------------------------------------------------------------------- the stage


QUICK = ["pair=toy-tiny", "max_new_tokens=8", "repeats=2", "step_time_iters=2", "plot=false"]
QUICK += ["hf_assisted=false", "dataset=stdlib-long", "dataset.buckets=[0-64,64-200]"]
QUICK += ["dataset.per_bucket=2", "num_prompts=null"]


@pytest.mark.usefixtures("one_thread")
def test_validate_writes_per_bucket_figures_and_stays_lossless(toy_tiny, tmp_path, monkeypatch):
    # fixed gamma: toy-tiny's drafter never pays, so the adaptive default's floor would spare
    # its prefill (0 s, rightly) and this test checks that both prefills are timed
    argv = ["validate", *QUICK, "decoder.draft_length=fixed", f"output_dir={tmp_path}"]
    monkeypatch.setattr("sys.argv", argv)
    main()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["lossless"] is True and report["prompts"] == 4
    low, high = report["speedup_range"]  # the headline's per-repeat range, beside its median
    assert 0 < low <= high
    assert (
        "| speedup (measured): median (range) of repeats |" in (tmp_path / "report.md").read_text()
    )
    rows = report["buckets"]
    assert [r["bucket"] for r in rows] == ["0-64", "64-200"]
    from specdistill.data.models.pairs import load_pair, resolve_pair

    target, drafter, _ = load_pair(resolve_pair({"toy": "toy-tiny"}))
    for r, (lo, hi) in zip(rows, [(0, 64), (64, 200)]):
        assert r["prompts"] == 2 and lo < r["mean_prompt_tokens"] <= r["max_prompt_tokens"] <= hi
        assert r["c"] > 0 and r["verify_cost"] > 0 and lo < r["probe_tokens"] <= hi
        assert r["prefill_seconds"]["target"] > 0 and r["prefill_seconds"]["drafter"] > 0
        kv = r["kv_cache"]
        assert kv["tokens"] == r["max_prompt_tokens"] + 8
        assert kv["target_bytes"] == kv_cache_bytes(target.config, kv["tokens"], torch.float32)
        assert kv["drafter_bytes"] == kv_cache_bytes(drafter.config, kv["tokens"], torch.float32)
        assert set(r["modes"]) == {"greedy", "sampling"}
        greedy = r["modes"]["greedy"]
        assert greedy["lossless"] is True and r["modes"]["sampling"]["lossless"] is None
        assert 0 <= greedy["alpha"] <= 1 and 1 <= greedy["tau"] <= report["gamma"] + 1
        assert greedy["speedup"] > 0 and greedy["decode_speedup"] > 0
        assert 0 <= greedy["drafter_alpha"] <= 1 and greedy["drafter_trials"] >= 0
        low, high = greedy["speedup_range"]
        assert 0 < low <= high
    text = (tmp_path / "report.md").read_text()
    assert "## By context-length bucket" in text and "| 64-200 | sampling | 2 |" in text
    assert "| alpha | the drafter's own alpha (drafts) | tau |" in text
    assert bucket_markdown(rows)[1] == "## By context-length bucket"


@pytest.mark.parametrize("batch", [1, 2])
def test_packed_gqa_attention_equals_transformers_sdpa(batch):
    """A verify's attention with the query packed onto the KV heads is transformers' SDPA with
    K and V expanded (`repeat_kv`), to fp32 rounding; a 1-token query is passed through."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module:
        num_key_value_groups = 3
        is_causal = True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 9, 5, 16, generator=g)
    k, v = torch.randn(batch, 3, 40, 16, generator=g), torch.randn(batch, 3, 40, 16, generator=g)
    mask = torch.ones(batch, 1, 5, 40, dtype=torch.bool)
    mask[..., -5:] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    mask[-1, ..., :7] = False  # left padding in the last row
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
    got, _ = packed_gqa_attention(Module(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (batch, 5, 9, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_gqa_model_decodes_token_identically_with_packed_verifies():
    """Greedy identity on a grouped-query target (9 heads over 3 KV heads), whose verifies run
    the packed attention, against cache-free greedy decoding."""
    from specdistill.decode.cache_layers import PACKED_SDPA
    from tests.decode.test_speculative import greedy_reference, truncated_copy

    target = tiny_llama(layers=3, hidden=36, seed=4, heads=9, kv_heads=3)
    assert target.config._attn_implementation == "sdpa"
    drafter = truncated_copy(target, 1)
    prompt = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(5))
    used = []
    inner = target.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        used.append(target.config._attn_implementation)
        return inner(*args, **kwargs)

    target.forward = forward
    try:
        dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=4, max_new_tokens=20))
        out = dec.generate(prompt)
    finally:
        del target.forward
    assert PACKED_SDPA in used and target.config._attn_implementation == "sdpa"
    assert 0 < out.accepted < out.trials
    assert out.tokens[0] == greedy_reference(target, prompt[0].tolist(), 20)


@pytest.mark.usefixtures("one_thread")
def test_a_drafter_reading_the_prompts_end_holds_that_much_kv(toy_tiny, tmp_path, monkeypatch):
    """`decoder.drafter_context=32`: each bucket's drafter KV is at most the longest prompt's last
    32 tokens + the new ones (the target's the whole prompt), and every decode stays lossless."""
    argv = ["validate", *QUICK, "decoder.draft_length=fixed", "decoder.drafter_context=32",
            "both_modes=false", "repeats=1", f"output_dir={tmp_path}"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    main()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["lossless"] is True and report["config"]["decoder"]["drafter_context"] == 32
    from specdistill.data.models.pairs import load_pair, resolve_pair

    _, drafter, _ = load_pair(resolve_pair({"toy": "toy-tiny"}))
    for r in report["buckets"]:
        kv = r["kv_cache"]
        assert kv["tokens"] == r["max_prompt_tokens"] + 8
        assert kv["drafter_tokens"] == min(kv["tokens"], 32 + 8)
        assert kv["drafter_bytes"] == kv_cache_bytes(
            drafter.config, kv["drafter_tokens"], torch.float32
        )
    assert report["buckets"][1]["kv_cache"]["drafter_tokens"] == 40  # 64-200: a cut prompt
    md = (tmp_path / "report.md").read_text()
    assert f"({report['buckets'][1]['kv_cache']['tokens']} / 40)" in md
