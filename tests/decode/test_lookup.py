"""Prompt lookup (decode.lookup): drafts copied from the context, lossless in both modes.

p = target, q = drafter. The n-gram index is checked against a brute-force scan, and the decoder
with `lookup=true` against target-only decoding: token-identical when greedy, the target's
sequence distribution (chi-square over every sequence of a small vocabulary) when sampling.
Every match takes its round (no gating).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DecoderSettings
from specdistill.decode.lookup import MAX_NGRAM, PromptLookup, find_continuation
from specdistill.decode.outputs import DecodeOutput, VerifiedRow
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_distribution import H, V, chi2_pvalue, exact_sequence_probs, sharp_llama
from tests.decode.test_mapped import bpe_pair as bpe_pair


def brute_continuation(history: list[int], min_ngram: int, k: int) -> list[int]:
    """The longest suffix n-gram (MAX_NGRAM..min_ngram) with an earlier occurrence, by scanning
    every start from the most recent back; the k tokens after that occurrence."""
    for n in range(MAX_NGRAM, min_ngram - 1, -1):
        if len(history) < n + 1:
            continue
        suffix = history[-n:]
        for s in range(len(history) - n - 1, -1, -1):
            if history[s : s + n] == suffix:
                return history[s + n : s + n + k]
    return []


@pytest.mark.parametrize("min_ngram", [1, 2, 3])
def test_index_finds_what_a_scan_finds(min_ngram):
    rng = random.Random(min_ngram)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 9])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        cut = rng.randrange(0, len(seq) + 1)
        look = PromptLookup(seq[:cut], min_ngram=min_ngram)
        # built as a decode builds it: the prompt, then its output row as it grows, twice read
        row = seq[cut:]
        look.catch_up(row[: rng.randrange(0, len(row) + 1)])
        look.catch_up(row)
        look.catch_up(row)
        assert look.history == seq
        k = rng.randrange(1, 6)
        got = find_continuation(look.history, look.index, min_ngram, k)
        assert got == brute_continuation(seq, min_ngram, k), (seq, k)


def test_setting_is_checked_and_listed():
    assert DecoderSettings.from_node({"lookup": True}).lookup is True
    with pytest.raises(ConfigError, match="decoder.lookup='yes'"):
        DecoderSettings.from_node({"lookup": "yes"})
    assert DecoderSettings.from_node({}).lookup is False  # opt-in: a drafter of its own
    with pytest.raises(ConfigError, match="decoder.lookup='auto' must be true or false"):
        DecoderSettings.from_node({"lookup": "auto"})  # no auto any more: on or off
    on = DecoderSettings.from_node({"lookup": True, "sampling": {"temperature": 1.0}})
    assert on.decoder_config(8, ()).lookup is True  # sampled decodes look up too


def repetitive_prompt(vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(1, vocab) for _ in range(5)]
    return motif * 3 + motif[:2]


@pytest.mark.parametrize("draft_length", ["fixed", "confidence"])
@pytest.mark.parametrize("drafter_kind", ["weak", "good"])
def test_greedy_lookup_is_token_identical(draft_length, drafter_kind):
    target = tiny_llama(vocab=24, layers=2, seed=3)
    drafter = tiny_llama(vocab=24, layers=1, seed=4) if drafter_kind == "weak" else target
    cfg = DecoderConfig(gamma=3, max_new_tokens=40, draft_length=draft_length, lookup=True)
    dec = SpeculativeDecoder(target, drafter, cfg)
    plain = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=3, max_new_tokens=40))
    rounds = accepted = 0
    for seed in range(6):
        ids = torch.tensor([repetitive_prompt(24, seed)])
        out = dec.generate(ids)
        assert out.tokens == dec.baseline(ids).tokens == plain.generate(ids).tokens
        rounds += out.lookup_rounds
        accepted += out.lookup_accepted
        assert out.lookup_drafted >= out.lookup_accepted
        assert 0.0 <= out.lookup_acceptance <= 1.0
    assert rounds > 0 and accepted > 0  # lookup rounds ran, and some of their drafts held


def test_every_match_takes_its_round(monkeypatch):
    """The drafter is the target (every draft it makes is kept, so its rounds pay more than
    any lookup round could): still, every round whose context has a match is a lookup round,
    at a fixed and an adaptive length; the output stays the target's greedy."""
    target = tiny_llama(vocab=24, layers=2, seed=3)
    found: list[bool] = []
    real = PromptLookup.propose

    def spy(self, budget):
        got = real(self, budget)
        want = find_continuation(self.history, self.index, self.min_ngram, budget)
        assert got == want and len(got) <= budget
        found.append(bool(got))
        return got

    monkeypatch.setattr(PromptLookup, "propose", spy)
    for draft_length in ("confidence", "fixed"):
        cfg = DecoderConfig(gamma=3, max_new_tokens=40, draft_length=draft_length, lookup=True)
        dec = SpeculativeDecoder(target, target, cfg)
        found.clear()
        taken = 0
        for seed in range(6):
            ids = torch.tensor([repetitive_prompt(24, seed)])
            out = dec.generate(ids)
            assert out.tokens == dec.baseline(ids).tokens
            taken += out.lookup_rounds
        assert 0 < sum(found) < len(found)  # some rounds matched, some fell to the drafter
        assert taken == sum(found)


def test_batches_decode_without_lookup():
    target = tiny_llama(vocab=24, layers=2, seed=3)
    cfg = DecoderConfig(gamma=2, max_new_tokens=12, lookup=True)
    dec = SpeculativeDecoder(target, tiny_llama(vocab=24, layers=1, seed=4), cfg)
    ids = torch.tensor([repetitive_prompt(24, 0), repetitive_prompt(24, 1)])
    out = dec.generate(ids, torch.ones_like(ids))
    assert out.lookup_rounds == 0
    assert out.tokens == dec.baseline(ids, torch.ones_like(ids)).tokens


PROMPT = [3, 1, 4, 1, 3, 1]  # "3 1" and "1" recur: lookup proposes 4 and 3 (vocab V = 8)


def lookup_counts(dec: SpeculativeDecoder, n: int, seed: int):
    """Sequence counts of n batch-1 decodes (lookup runs at batch 1 only) and the lookup totals."""
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    ids = torch.tensor([PROMPT])
    drafted = accepted = 0
    for _ in range(n):
        out = dec.generate(ids, generator=gen)
        counts[tuple(out.tokens[0])] = counts.get(tuple(out.tokens[0]), 0) + 1
        drafted += out.lookup_drafted
        accepted += out.lookup_accepted
    return counts, drafted, accepted


@pytest.fixture(scope="module")
def sharp_pair():
    target = sharp_llama(seed=11, layers=2)
    drafter = copy.deepcopy(target)
    drafter.model.layers = drafter.model.layers[:1]
    drafter.config.num_hidden_layers = 1
    return target, drafter


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_k=3)], ids=["t1", "topk"])
def test_sampled_lookup_follows_the_target_distribution(sharp_pair, sampling):
    target, drafter = sharp_pair
    cfg = DecoderConfig(
        gamma=2, max_new_tokens=H, sampling=sampling, lookup=True, draft_length="confidence"
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    n = 3000
    counts, drafted, accepted = lookup_counts(dec, n, seed=1)
    assert drafted > n and 0 < accepted < drafted  # lookup drafts ran, some held, some not
    assert chi2_pvalue(exact_sequence_probs(target, sampling, PROMPT), counts, n) > 1e-3


def test_lossy_lookup_is_detected(sharp_pair):
    """The same test has the power to see a wrong rule: lenience 0.3 accepts lookup drafts
    with probability min(1, p / 0.3), and the output drifts from p."""
    target, drafter = sharp_pair
    s = Sampling(1.0)
    cfg = DecoderConfig(
        gamma=2, max_new_tokens=H, sampling=s, lookup=True, draft_length="confidence",
        lenience=0.3,
    )  # fmt: skip
    counts, drafted, _ = lookup_counts(SpeculativeDecoder(target, drafter, cfg), 3000, seed=2)
    assert drafted > 3000
    assert chi2_pvalue(exact_sequence_probs(target, s, PROMPT), counts, 3000) < 1e-6


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("draft_length", ["fixed", "confidence"])
def test_parallel_drafter_reads_what_lookup_rounds_emitted(draft_length, cache):
    """A parallel drafter lags by the tokens of lookup rounds (t and the accepted drafts, at
    their positions) and reads them in its next forward: still token-identical."""
    from tests.decode.test_parallel import MASK, parallel_cfg
    from tests.decode.test_speculative import greedy_reference, truncated_copy

    target = sharp_llama(seed=3, layers=3, scale=6.0)
    drafter = truncated_copy(target, 2)
    cfg = parallel_cfg(MASK, gamma=3, max_new_tokens=24, cache=cache, lookup=True,
                       draft_length=draft_length)  # fmt: skip
    dec = SpeculativeDecoder(target, drafter, cfg)
    rounds = 0
    for seed in range(4):
        prompt = [t if t != MASK else 1 for t in repetitive_prompt(V, seed)]
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        rounds += out.lookup_rounds
    assert rounds > 0


@pytest.mark.parametrize("context", ["tli", "text"])
def test_mapped_drafter_reads_what_lookup_rounds_emitted(bpe_pair, context):
    """A drafter with its own tokenizer lags by lookup rounds' tokens like by plain steps."""
    from tests.decode.test_mapped import decoder
    from tests.decode.test_speculative import greedy_reference

    target, _, _, t_tok, _ = bpe_pair
    dec = decoder(bpe_pair, context, gamma=3, max_new_tokens=24, lookup=True)
    rounds = 0
    for text in ["a = b + c\na = b + c\na = b", "for x in xs:\n    f(x)\nfor x in xs:\n    f("]:
        ids = t_tok(text, return_tensors="pt").input_ids
        out = dec.generate(ids)
        assert out.tokens[0] == greedy_reference(target, ids[0].tolist(), 24)
        rounds += out.lookup_rounds
    assert rounds > 0


@pytest.mark.parametrize(
    ("engines", "lookup", "expect"),
    [("[ours]", "true", True), ("[ours,vllm]", "false", False), ("[ours,vllm]", "true", True)],
)
def test_both_serving_modes_take_the_lookup_setting(tmp_path, engines, lookup, expect):
    """`decoder.lookup` is on or off as given, in both serving modes, whatever the engines
    (vLLM runs the drafter alone unless asked); `auto` is refused."""
    from hydra import compose, initialize_config_module

    from specdistill.decode.validate.settings import ValidateSettings

    def settings(value: str):
        overrides = [f"output_dir={tmp_path}", f"engines={engines}", f"decoder.lookup={value}"]
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            return ValidateSettings.from_cfg(compose(config_name="validate", overrides=overrides))

    vs = settings(lookup)
    assert vs.decoder.lookup == expect and vs.other is not None and vs.other.lookup == expect
    with pytest.raises(ConfigError, match="lookup"):
        settings("auto")


def test_the_drafters_own_alpha_leaves_lookup_rounds_out():
    """The target as its own drafter (greedy: every draft it makes is kept) with lookup on a
    repetitive prompt: lookup drafts are sometimes rejected, so the totals (alpha, accepted_at)
    fall below 1 while the drafter's own acceptance stays exactly 1; counted round by round
    (record_probs), the drafter's counters are the totals less the lookup rounds'; `merge` of
    several decodes keeps them apart too."""
    from specdistill.decode.validate.modes import merge

    target = tiny_llama(vocab=24, layers=2, seed=3)
    cfg = DecoderConfig(gamma=3, max_new_tokens=40, lookup=True)
    dec = SpeculativeDecoder(target, target, cfg)
    outs = [dec.generate(torch.tensor([repetitive_prompt(24, seed)])) for seed in range(6)]
    total = merge(outs)
    assert total.lookup_rounds > 0 and total.lookup_accepted < total.lookup_drafted
    assert total.alpha < 1.0
    assert total.drafter_alpha == 1.0
    tested = [t - lt for t, lt in zip(total.trials_at, total.lookup_trials_at)]
    assert sum(tested) > 0
    assert all(a == 1.0 for a, t in zip(total.drafter_alpha_at(), tested) if t)
    assert total.lookup_trials == sum(total.lookup_trials_at) > 0

    # by hand: a lookup round of 3 drafts keeping 1 and a drafter round of 2 keeping 2
    def counters() -> dict[str, list[int]]:  # fresh lists: count_round adds into them
        return {f"{p}{n}_at": [0] * 3 for p in ("", "lookup_") for n in ("accepted", "trials")}

    out = DecodeOutput(tokens=[[]], draft_lengths=[0] * 4, **counters())
    out.count_round(
        [VerifiedRow.from_host([5, 6, 7, 1, 9, 1.0, 0.0, 0.5], 3)], [True], [3], lookup=True
    )
    out.count_round([VerifiedRow.from_host([5, 6, 2, 9, 1.0, 1.0], 2)], [True], [2])
    assert out.alpha == pytest.approx((1.0 + 0.0 + 1.0 + 1.0) / 4)
    assert out.drafter_alpha == 1.0
    assert out.drafter_alpha_at() == [1.0, 1.0, 0.0]
    assert out.accepted_at == [2, 1, 0] and out.trials_at == [2, 2, 0]
    assert out.drafter_trials == 2 and out.drafter_trials_at() == [1, 1, 0]
    assert total.drafter_trials == sum(tested) == sum(total.drafter_trials_at())
    # a decode whose every tested draft was lookup's: its own 0.0 rests on no drafts
    only = DecodeOutput(tokens=[[]], draft_lengths=[0] * 4, **counters())
    only.count_round(
        [VerifiedRow.from_host([5, 6, 7, 1, 9, 1.0, 0.0, 0.5], 3)], [True], [3], lookup=True
    )
    assert only.drafter_alpha == 0.0 and only.drafter_trials == 0
    assert only.drafter_trials_at() == [0, 0, 0] and only.trials > 0
