"""Validate by context-length bucket, and the decoder's cost at long context.

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
from specdistill.decode.cache_layers import KV_FORMULA, cache_nbytes, kv_cache_bytes, slot_layer
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate.buckets import (
    bucket_markdown,
    bucket_mode_figures,
    group_batches,
    with_theory,
)
from specdistill.decode.validate.modes import TimedPass
from specdistill.decode.validate.stage import main
from tests.conftest import tiny_llama
from tests.decode.sliding_models import mistral

# ----------------------------------------------------------------------------- aggregation


def _out(
    tokens, alpha_sum=0.0, trials=0, block=0, rounds=0, look=(0.0, 0, 0, 0, 0), acc=(), tried=()
) -> DecodeOutput:
    """look: lookup's (alpha sum, trials, rounds, drafted, accepted)."""
    return DecodeOutput(
        tokens=tokens,
        alpha_sum=alpha_sum,
        trials=trials,
        lookup_alpha_sum=look[0],
        lookup_trials=look[1],
        lookup_rounds=look[2],
        lookup_drafted=look[3],
        lookup_accepted=look[4],
        block_tokens=block,
        row_rounds=rounds,
        accepted_at=list(acc),
        trials_at=list(tried),
    )


def _passes() -> list[TimedPass]:
    """Three batches of one prompt each: batches 0 and 2 are bucket A, batch 1 bucket B."""
    base = [_out([[1] * 4]), _out([[2] * 6]), _out([[3] * 4])]
    spec = [
        _out([[1] * 4], alpha_sum=3.0, trials=4, block=4, rounds=2, acc=(2, 1, 0), tried=(2, 2, 1)),
        _out([[2] * 6], alpha_sum=1.0, trials=5, block=6, rounds=5, look=(1.0, 2, 1, 2, 1), acc=(1, 0, 0),
             tried=(4, 1, 0)),
        _out([[3, 3, 3, 9]], alpha_sum=1.0, trials=4, block=4, rounds=2, acc=(1, 0, 0),
             tried=(2, 1, 0)),
    ]  # fmt: skip
    first = TimedPass([1.5, 5.0, 2.5], base, [1.0, 4.0, 1.4], spec)
    # the second repeat: same tokens, other seconds, no counters (the figures read the first's)
    second = TimedPass(
        [2.0, 6.0, 2.0], [_out(o.tokens) for o in base], [1.2, 4.0, 1.2],
        [_out(o.tokens) for o in spec],
    )  # fmt: skip
    return [first, second]


def test_bucket_figures_match_hand_computed_values():
    passes = _passes()
    a = bucket_mode_figures([0, 2], passes, greedy=True)
    # repeat 1: base 8 tokens / 4.0 s = 2.0, spec 8 / 2.4 = 3.333; repeat 2: 8/4.0 = 2.0,
    # 8/2.4 = 3.333 -> speedup 1.667
    assert a["speedup"] == 1.667
    assert a["baseline_tokens_per_s"]["median"] == 2.0
    assert a["alpha"] == round((3.0 + 1.0) / 8, 4) and a["tau"] == round(8 / 4, 3)
    # by position over batches 0 and 2: accepted (2+1, 1+0, 0+0) of (2+2, 2+1, 1+0) tested
    assert a["acceptance_by_position"] == [0.75, 0.3333, 0.0]
    assert a["lossless"] is False  # batch 2's speculative row differs from target-only
    b = bucket_mode_figures([1], passes, greedy=True)
    # base 6/5.0 and 6/6.0, spec 6/4.0 twice: 1.5 / 1.1 = 1.364
    assert b["speedup"] == round(1.5 / 1.1, 3) and b["lossless"] is True
    # each repeat's own ratio: 1.5 / 1.2 and 1.5 / 1.0 (bucket A's repeats agree)
    assert b["speedup_range"] == [1.25, 1.5] and a["speedup_range"] == [1.667, 1.667]
    assert b["alpha"] == 0.2 and b["tau"] == 1.2
    assert b["acceptance_by_position"] == [0.25, 0.0, 0.0]  # position 3 never tested: 0.0
    # the drafter's own: bucket B's 5 tests less lookup's 2 (1 accepted) -> 0 of 3; bucket A
    # had no lookup round: its own alpha is every draft's, over all 8 tests
    assert (b["drafter_alpha"], b["drafter_trials"]) == (0.0, 3)
    assert (a["drafter_alpha"], a["drafter_trials"]) == (a["alpha"], 8)
    assert "lookup_round_share" not in a  # no lookup round anywhere in bucket A
    # bucket B: 1 of its 5 rounds drafted from the context, 1 of that round's 2 drafts kept
    assert (b["lookup_round_share"], b["lookup_acceptance"]) == (0.2, 0.5)
    assert bucket_mode_figures([1], passes, greedy=False)["lossless"] is None
    for gone in ("decode_speedup", "prefill_seconds", "baseline_decode_tokens_per_s"):
        assert gone not in a


def test_modeled_speedup_uses_the_buckets_c_verify_cost_and_acceptance():
    fig = {"acceptance_by_position": [0.5, 0.25], "alpha": 0.4}
    out = with_theory(fig, gamma=3, c=0.25, verify_cost=1.6)
    # positions padded to gamma with 0: E = 1 + 0.5 + 0.5 * 0.25 + 0 = 1.625; the verify's
    # (1.6 - 1) spread over 3 drafts: cost 3 * 0.25 + 1 + 3 * 0.2 = 2.35 -> 0.691
    assert out["modeled_speedup"] == 0.691
    assert out["alpha"] == 0.4 and "modeled_speedup" not in fig  # a copy, the figures kept
    # acceptance past gamma is ignored: E = 1 + 0.8 + 0.48 = 2.28 over 2 * 0.1 + 1 = 1.9; a
    # verify dearer than a step by nothing (or cheaper, 0.9: timing noise) adds no cost
    longer = {"acceptance_by_position": [0.8, 0.6, 0.4]}
    assert with_theory(longer, gamma=2, c=0.1, verify_cost=1.0)["modeled_speedup"] == 1.9
    assert with_theory(longer, gamma=2, c=0.1, verify_cost=0.9)["modeled_speedup"] == 1.9
    # no position measured (every round verified none): one plain step per round's cost
    assert with_theory({"acceptance_by_position": []}, 1, 0.5, 1.0)["modeled_speedup"] == 0.667


def test_bucket_markdown_row_matches_the_figures():
    a = with_theory(bucket_mode_figures([0, 2], _passes(), greedy=True), 3, 0.25, 1.6)
    kv = {"tokens": 48, "drafter_tokens": 40, "target_bytes": 2**20, "drafter_bytes": 2**19}
    row = {"bucket": "A", "prompts": 2, "mean_prompt_tokens": 30.5, "c": 0.25,
           "verify_cost": 1.6, "kv_cache": kv, "modes": {"greedy": a}}  # fmt: skip
    lines = bucket_markdown([row])
    assert lines[1] == "## By context-length bucket"
    head = [c.strip() for c in lines[3].strip("|").split("|")]
    assert head[:6] == ["bucket", "mode", "prompts", "mean prompt tokens", "tau",
                        "acceptance by position"]  # fmt: skip
    assert head[-3:] == ["modeled", "KV MiB, target / drafter (tokens)", "lossless"]
    assert len(head) == 13 and lines[4].count("|") == 14
    assert lines[5] == (
        f"| A | greedy | 2 | 30.5 | 2.0 | 0.75 0.33 0.00 | 0.5 (8) | 0.25 | 1.6 | 1.667x | "
        f"{a['modeled_speedup']}x | 1.0 / 0.5 (48 / 40) | False |"
    )
    assert bucket_markdown([]) == [] and bucket_markdown(None) == []


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
        assert "prefill_seconds" not in r
        kv = r["kv_cache"]
        assert kv["tokens"] == r["max_prompt_tokens"] + 8
        assert kv["target_bytes"] == kv_cache_bytes(target.config, kv["tokens"], torch.float32)
        assert kv["drafter_bytes"] == kv_cache_bytes(drafter.config, kv["tokens"], torch.float32)
        assert set(r["modes"]) == {"greedy", "sampling"}
        greedy = r["modes"]["greedy"]
        assert greedy["lossless"] is True and r["modes"]["sampling"]["lossless"] is None
        assert 0 <= greedy["alpha"] <= 1 and 1 <= greedy["tau"] <= report["gamma"] + 1
        assert greedy["speedup"] > 0 and "decode_speedup" not in greedy
        assert 0 <= greedy["drafter_alpha"] <= 1 and greedy["drafter_trials"] >= 0
        for m in r["modes"].values():
            at = m["acceptance_by_position"]
            assert len(at) == report["gamma"] and all(0 <= x <= 1 for x in at)
            want = with_theory(m, report["gamma"], r["c"], r["verify_cost"])["modeled_speedup"]
            assert m["modeled_speedup"] == pytest.approx(want, abs=2e-3)  # c, verify rounded
        low, high = greedy["speedup_range"]
        assert 0 < low <= high
    text = (tmp_path / "report.md").read_text()
    assert "## By context-length bucket" in text and "| 64-200 | sampling | 2 |" in text
    assert "| tau | acceptance by position | the drafter's own alpha (drafts) |" in text
    assert bucket_markdown(rows)[1] == "## By context-length bucket"


def test_a_gqa_model_decodes_token_identically():
    """Greedy identity on a grouped-query target (9 heads over 3 KV heads: its verifies attend
    through the model's own GQA) against cache-free greedy decoding."""
    from tests.decode.test_speculative import greedy_reference, truncated_copy

    target = tiny_llama(layers=3, hidden=36, seed=4, heads=9, kv_heads=3)
    assert target.config.num_key_value_heads == 3
    drafter = truncated_copy(target, 1)
    prompt = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(5))
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=4, max_new_tokens=20))
    out = dec.generate(prompt)
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
