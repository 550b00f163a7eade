"""`decoder.drafter_context`: a drafter that reads only the end of the prompt.

p = target, q = drafter. The cut drops the prompt's first slots from q's cache only: q must then
draft exactly what it drafts from a prompt that starts at the cut (rotary positions are
relative; batched rows shift their positions by their own tokens before the cut), and the
decode stays token-identical to the target's greedy decoding whatever q reads. References are
computed without any KV cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DecoderSettings
from specdistill.decode.drafters.context import check_drafter_context, context_cut
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_mapped import TEXTS
from tests.decode.test_mapped import bpe_pair as bpe_pair
from tests.decode.test_mapped import decoder as mapped_decoder
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy

MASK = 2
K = 3
# confidence: this random drafter's top q lies near 1/64 (0.019..0.021): a p_min among those
# stops some rounds early and some before any draft (plain target steps)
P_MIN = 0.0197


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=4)
    return target, truncated_copy(target, 2)


def test_context_cut_rules():
    """all: nothing; auto: only what would take q past its positions; N: the last N prompt
    slots (and auto's bound); never the last prompt token."""
    assert context_cut(100, 140, "all", 64) == 0
    assert context_cut(100, 140, "auto", None) == 0
    assert context_cut(100, 140, "auto", 8192) == 0
    assert context_cut(100, 140, "auto", 128) == 12  # 140 positions into 128
    assert context_cut(100, 140, 30, None) == 70
    assert context_cut(100, 140, 30, 128) == 70 and context_cut(100, 140, 95, 128) == 12
    assert context_cut(20, 140, 30, None) == 0  # a prompt shorter than N: all of it
    assert context_cut(100, 400, "auto", 128) == 99  # the last prompt token always stays
    assert context_cut(1, 10, 1, None) == 0
    for bad in (0, -3, "half", True, 2.5):
        with pytest.raises(ConfigError, match="drafter_context"):
            check_drafter_context(bad)
    with pytest.raises(ConfigError, match=r"decoder.drafter_context=0"):
        DecoderSettings.from_node({"drafter_context": 0})
    assert (
        DecoderSettings.from_node({"drafter_context": 512}).decoder_config(8, ()).drafter_context
        == 512
    )


def _start(dec: SpeculativeDecoder, ids: torch.Tensor, mask0: torch.Tensor):
    """A decode's start as the round loop makes it (the shared slot mask, the cut), with the
    first round's slots opened; returns the pending token and its position per row."""
    b, plen = ids.shape
    dense = b == 1
    mask = torch.zeros(b, dec.spec_capacity(b, plen), dtype=torch.bool)
    mask[:, :plen] = mask0
    mask[:, plen - 1 : plen + K] = True  # the round's slots (the loop opens them for rows)
    dec.drafting.start(ids, mask0, mask, dense, dec.spec_slots(b, plen), dec.drafter_cut(plen))
    return ids[:, -1], mask0.long().sum(1) - 1


@torch.inference_mode()
def _reference_q(drafter, context: list[int], drafts: list[int], parallel: bool) -> torch.Tensor:
    """q of a round's K drafts without a cache: the drafter over the context and the round's
    earlier drafts (autoregressive) or K-1 mask tokens (parallel), softmax at the last K."""
    tail = [MASK] * (K - 1) if parallel else drafts[: K - 1]
    return torch.softmax(drafter(torch.tensor([context + tail])).logits[0, -K:].float(), -1)


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
@pytest.mark.parametrize("n", [1, 4, 7])
def test_a_cut_drafter_drafts_as_from_a_prompt_that_starts_at_the_cut(pair, drafting, n):
    """Batch 1 (dense: positions from q's own cache) and left-padded rows (positions shifted by
    each row's tokens before the cut): q of the first round's drafts equals a cache-free
    forward over each row's last n prompt tokens (sampling, so q itself is compared)."""
    target, drafter = pair
    parallel = drafting == "parallel"
    cfg = DecoderConfig(gamma=K, max_new_tokens=8, drafter_context=n, drafting=drafting,
                        mask_token_id=MASK if parallel else None,
                        sampling=Sampling(temperature=1.0))  # fmt: skip
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(4, 64, seed=n)  # lengths 5, 12, 1, 8
    g = torch.Generator().manual_seed(n)

    def check(proposal, batch_rows):
        for r, row in enumerate(batch_rows):
            want = _reference_q(drafter, row[-n:], proposal.tokens[r].tolist(), parallel)
            torch.testing.assert_close(proposal.q[r].float(), want, atol=2e-6, rtol=1e-4)

    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([row])
            t, pos = _start(dec, ids, torch.ones_like(ids, dtype=torch.bool))
            assert dec.drafting.cut == max(0, len(row) - n)
            check(dec.drafting.propose(t, pos, K, g), [row])
        ids, mask0 = left_pad(rows)
        t, pos = _start(dec, ids, mask0.bool())
        assert dec.drafting.cut == ids.shape[1] - n
        check(dec.drafting.propose(t, pos, K, g), rows)


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("draft_length", ["fixed", "confidence"])
def test_greedy_identity_with_a_cut(pair, drafting, cache, draft_length):
    target, drafter = pair
    cfg = DecoderConfig(gamma=K, max_new_tokens=20, drafter_context=4, drafting=drafting,
                        mask_token_id=MASK if drafting == "parallel" else None, cache=cache,
                        draft_length=draft_length, max_draft=4, p_min=P_MIN)  # fmt: skip
    dec = SpeculativeDecoder(target, drafter, cfg)
    rows = prompts(6, 64, seed=11)
    accepted = trials = 0
    lengths = set()  # draft lengths the rounds verified
    for row in rows:
        out = dec.generate(torch.tensor([row]))
        assert out.tokens[0] == greedy_reference(target, row, 20)
        accepted, trials = accepted + out.accepted, trials + out.trials
        lengths |= {k for k, n in enumerate(out.draft_lengths) if n}
    assert 0 < accepted < trials  # q drafts and is sometimes wrong: the rounds roll back
    if draft_length == "confidence":  # rounds stopped at different drafts, some at none
        assert 0 in lengths and len(lengths) > 2
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, r, 20) for r in rows]


def test_auto_keeps_a_short_context_drafter_within_its_positions(pair):
    """A drafter trained on 16 positions beside a longer-context target: `auto` cuts the prompt
    so q never reads a slot (batch 1: a position) past 16; `all` runs it past them; both
    lossless."""
    target, drafter = pair
    short = copy.deepcopy(drafter)
    short.config.max_position_embeddings = 16
    row = prompts(2, 64, seed=5)[1]  # 12 tokens
    furthest = {}
    for context in ("auto", "all"):
        cfg = DecoderConfig(gamma=2, max_new_tokens=10, drafter_context=context)
        dec = SpeculativeDecoder(target, short, cfg)
        reached = [0]
        make = dec.drafting.make_runner

        def recording(slots, make=make, reached=reached):
            runner = make(slots)
            forward = runner.forward

            def counted(ids, *args, **kw):
                reached[0] = max(reached[0], runner.length + ids.shape[1])
                return forward(ids, *args, **kw)

            runner.forward = counted
            return runner

        dec.drafting.make_runner = recording
        out = dec.generate(torch.tensor([row]))
        assert out.tokens[0] == greedy_reference(target, row, 10)
        assert out.trials > 0  # q drafted
        furthest[context] = reached[0]
        if context == "auto":
            assert dec.drafter_cut(12) == 12 + 10 + 2 + 1 - 16
    assert furthest["auto"] <= 16 < furthest["all"]


def test_a_static_drafter_cache_reads_a_padded_view_of_the_mask(pair):
    """A compiled drafter's capacity is bucketed: after a cut it may outgrow the shared mask's
    view, which is then padded with unwritten (False) slots, never cut short."""
    target, drafter = pair
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=K, max_new_tokens=8,
                                                            drafter_context=4, cache="static"))  # fmt: skip
    rows = prompts(4, 64, seed=2)
    ids, mask0 = left_pad(rows)
    with torch.inference_mode():
        _start(dec, ids, mask0.bool())
    d = dec.drafting
    assert d.runner.static and d._slot_mask().shape[1] == d.mask.shape[1]
    d.runner.capacity = d.mask.shape[1] + 5  # as a bucketed capacity would be
    padded = d._slot_mask()
    assert padded.shape[1] == d.runner.capacity
    assert torch.equal(padded[:, : d.mask.shape[1]], d.mask) and not padded[:, -5:].any()


@pytest.mark.parametrize("context", ["tli", "text"])
def test_a_mapped_drafter_with_a_cut_stays_lossless(bpe_pair, context):
    """A drafter with its own tokenizer reads the end of the prompt too (tli: its slots; text:
    the text of the target tokens from the cut on); batch 1 and batched, greedy identity."""
    target, _, _, t_tok, _ = bpe_pair
    dec = mapped_decoder(bpe_pair, context, gamma=3, max_new_tokens=12, drafter_context=3)
    accepted = 0
    rows = [t_tok(x).input_ids for x in TEXTS]
    for row in rows:
        out = dec.generate(torch.tensor([row]))
        assert out.tokens[0] == greedy_reference(target, row, 12)
        accepted += out.accepted
    assert accepted > 0
    ids, mask = left_pad(rows, t_tok.pad_token_id)
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, row, 12) for row in rows]
