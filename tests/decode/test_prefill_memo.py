"""Prefill once per (model, prompt): restored caches decode exactly as fresh ones (issue 36).

p = target, q = drafter. A restored prefill must be invisible in the outputs (greedy and
sampled tokens identical to a decode that prefilled, batch 1 and padded batches, a sliding-
window model, target and drafter both), honest in the timings (a hit reports the one run's
seconds and what it saved; validate's wall clock adds that back), bounded in memory, and
never shared between two models fed the same ids.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.runtime import ConfigError, pad_rows
from specdistill.data.sampling import Sampling
from specdistill.decode.cache import ModelRunner
from specdistill.decode.draft_length import DraftCosts
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.prefill_memo import PrefillMemo, prefill_timed
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate.modes import _timed_call
from specdistill.decode.validate.stage import main
from tests.conftest import tiny_llama
from tests.decode.sliding_models import mistral


def _pair(make=tiny_llama):
    return make(vocab=64, layers=3, seed=0), make(vocab=64, layers=1, seed=1)


def _prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (23, 17, 30)[:batch]]
    return pad_rows(rows, 0)


def _decode(dec: SpeculativeDecoder, ids, mask, fn: str, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return getattr(dec, fn)(ids, mask, generator=gen)


@pytest.mark.parametrize("make", [tiny_llama, mistral], ids=["llama", "sliding"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
@pytest.mark.parametrize("draft_length", ["fixed", "confidence"])
def test_restored_prefills_decode_exactly_as_fresh_ones(make, batch, greedy, draft_length):
    target, drafter = _pair(make)
    s = Sampling() if greedy else Sampling(temperature=1.0)
    # given costs: timed ones would move an adaptive policy's lengths (and the random stream)
    costs = DraftCosts(c=0.2, verify_per_token=0.05, round_overhead=0.1)
    cfg = DecoderConfig(
        gamma=3, max_new_tokens=12, sampling=s, draft_length=draft_length, draft_costs=costs
    )
    ids, mask = _prompts(batch)
    memo = PrefillMemo()
    plain = SpeculativeDecoder(target, drafter, cfg)
    cached = SpeculativeDecoder(target, drafter, cfg, prefill_memo=memo)
    # the same calls in the same order (an adaptive policy learns across decodes): the first
    # runs each prefill, the later ones restore it
    calls = ["baseline", "generate", "baseline", "generate", "generate"]
    for fn in calls:
        assert _decode(cached, ids, mask, fn).tokens == _decode(plain, ids, mask, fn).tokens
    assert memo.hits >= 3 and memo.misses >= 1
    # a fresh decoder sharing the memo (validate's other serving mode) restores too
    hits = memo.hits
    other = SpeculativeDecoder(target, drafter, cfg, prefill_memo=memo)
    fresh = SpeculativeDecoder(target, drafter, cfg)
    assert (
        _decode(other, ids, mask, "generate").tokens == _decode(fresh, ids, mask, "generate").tokens
    )
    assert memo.hits > hits


def test_the_drafters_prefill_is_kept_apart_from_the_targets():
    target, drafter = _pair()
    cfg = DecoderConfig(gamma=2, max_new_tokens=6, draft_length="fixed")
    memo = PrefillMemo()
    dec = SpeculativeDecoder(target, drafter, cfg, prefill_memo=memo)
    ids, mask = _prompts(1)
    _decode(dec, ids, mask, "generate")
    assert memo.misses == 2 and memo.hits == 0  # same ids, two models: two entries
    out = _decode(dec, ids, mask, "generate")
    assert memo.hits == 2
    assert out.prefill_saved_s <= out.prefill_target_s + out.prefill_drafter_s


def test_a_hit_reports_the_measured_seconds_and_what_it_saved():
    target, _ = _pair()
    memo = PrefillMemo()
    ids, mask = _prompts(1)
    runs = []
    for _ in range(3):
        runner = ModelRunner(target, static=False, capacity=64)
        with torch.inference_mode():
            runs.append((runner, prefill_timed(runner, ids, mask, True, memo)))
    (r0, first), (r1, hit), (_, hit2) = runs
    assert first.saved == 0.0 and first.seconds > 0
    assert hit.seconds == hit2.seconds == first.seconds and 0.0 <= hit.saved <= hit.seconds
    assert r1.length == r0.length == ids.shape[1] - 1
    for a, b in zip(r0.cache.layers, r1.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(first.t, hit.t) and torch.equal(first.pos, hit.pos)


def test_static_caches_and_one_token_prompts_prefill_as_before():
    target, _ = _pair()
    memo = PrefillMemo()
    ids, mask = _prompts(1)
    runner = ModelRunner(target, static=True, capacity=64)
    with torch.inference_mode():
        prefill_timed(runner, ids, mask, True, memo)
        one = prefill_timed(ModelRunner(target, static=False, capacity=8), ids[:, :1], mask[:, :1],
                            True, memo)  # fmt: skip
    assert memo.hits == memo.misses == 0 and runner.length == ids.shape[1] - 1
    assert one.seconds == 0.0 and int(one.pos) == 0


def test_the_memo_stays_within_its_bytes_and_keeps_what_it_holds():
    target, _ = _pair()
    ids, mask = _prompts(1)
    probe = PrefillMemo()
    with torch.inference_mode():
        prefill_timed(ModelRunner(target, static=False, capacity=64), ids, mask, True, probe)
    size = probe.nbytes
    assert size > 0
    memo = PrefillMemo(max_bytes=2 * size)
    prompts = [(ids + k) % 64 for k in range(3)]
    with torch.inference_mode():
        for _ in range(2):  # validate's order: the same sweep every repeat
            for p in prompts:
                prefill_timed(ModelRunner(target, static=False, capacity=64), p, mask, True, memo)
    # the first two were kept and restored on the second sweep; the third never fit (an LRU
    # memo would have dropped each prompt just before its reuse: no hit at all)
    assert memo.nbytes == 2 * size and memo.hits == 2 and memo.misses == 4
    tiny = PrefillMemo(max_bytes=size - 1)  # an entry bigger than the memo is never kept
    with torch.inference_mode():
        prefill_timed(ModelRunner(target, static=False, capacity=64), ids, mask, True, tiny)
    assert tiny.nbytes == 0


def test_validate_counts_a_restored_prefill_as_its_measured_seconds():
    class Saved:
        def __call__(self, ids, mask, generator=None):
            return DecodeOutput(tokens=[[1]], prefill_target_s=5.0, prefill_saved_s=4.5)

    seconds: list[float] = []
    _timed_call(Saved(), None, None, None, seconds, [])
    assert 4.5 <= seconds[0] < 5.0


QUICK = ["pair=toy-tiny", "max_new_tokens=8", "repeats=2", "step_time_iters=2", "plot=false"]
QUICK += ["hf_assisted=false", "dataset=stdlib-long", "dataset.buckets=[0-64,64-200]"]
QUICK += ["dataset.per_bucket=2", "num_prompts=null", "decoder.draft_length=fixed"]


@pytest.mark.usefixtures("one_thread")
def test_validate_prefills_each_long_prompt_once_with_the_same_outputs(
    toy_tiny, tmp_path, monkeypatch
):
    reports = {}
    for once in ("auto", "false"):
        out = tmp_path / once
        monkeypatch.setattr("sys.argv", ["validate", *QUICK, f"prefill_once={once}",
                                         f"output_dir={out}"])  # fmt: skip
        main()
        reports[once] = json.loads((out / "report.json").read_text())
    memo, plain = reports["auto"], reports["false"]
    assert memo["lossless"] is True and plain["lossless"] is True
    notes = [n for n in memo["notes"] if n.startswith("prefill_once")]
    assert len(notes) == 1 and "restored" in notes[0]
    assert not [n for n in plain["notes"] if n.startswith("prefill_once")]
    for mode in ("greedy", "sampling"):  # same decodes: the same acceptance, bucket by bucket
        assert memo["modes"][mode]["alpha"] == plain["modes"][mode]["alpha"]
        for a, b in zip(memo["buckets"], plain["buckets"]):
            assert a["modes"][mode]["alpha"] == b["modes"][mode]["alpha"]
            assert a["prefill_seconds"]["target"] > 0


def test_prefill_once_is_checked_and_auto_means_long_prompt_sets():
    from hydra import compose, initialize_config_module

    from specdistill.decode.validate.settings import ValidateSettings

    def settings(*overrides: str) -> ValidateSettings:
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            return ValidateSettings.from_cfg(
                compose(config_name="validate", overrides=[*overrides])
            )

    with pytest.raises(ConfigError, match="prefill_once='always' is not known.*auto, true, false"):
        settings("prefill_once=always")
    auto = settings()
    assert auto.prefills_once(bucketed=True) and not auto.prefills_once(bucketed=False)
    assert settings("prefill_once=true").prefills_once(bucketed=False)
    assert not settings("prefill_once=false").prefills_once(bucketed=True)
