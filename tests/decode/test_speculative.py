"""The speculative decoder is lossless: greedy output == the target's own greedy output.

p = target, q = drafter. Drafters are truncated or differently seeded copies so acceptance is
partial (every test asserts it is), and references are computed without any KV cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.data.runtime import pad_rows
from specdistill.data.sampling import Sampling
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama


def truncated_copy(model, layers: int = 1):
    """A drafter that shares the target's embeddings and first layers: agrees often, not always."""
    d = copy.deepcopy(model)
    d.model.layers = d.model.layers[:layers]
    d.config.num_hidden_layers = layers
    return d


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    return target, truncated_copy(target)


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], n: int, eos: tuple[int, ...] = ()) -> list[int]:
    """Cache-free greedy decoding: full forward over the whole sequence at every step."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = int(model(torch.tensor([seq], device=model.device)).logits[0, -1].argmax())
        seq.append(tok)
        out.append(tok)
        if tok in eos:
            break
    return out


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_rows(rows, pad)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 12, 1, 8, 3, 9][:n]
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_is_token_identical_batch1(pair, gamma, cache):
    target, drafter = pair
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=gamma, max_new_tokens=24, cache=cache)
    )
    drafted = accepted = 0
    for prompt in prompts(4, 64, seed=gamma):
        ids = torch.tensor([prompt])
        out = dec.generate(ids)
        assert out.tokens[0] == greedy_reference(target, prompt, 24)
        assert dec.baseline(ids).tokens == out.tokens
        drafted += out.drafter_forwards
        accepted += out.accepted
        assert out.target_forwards < 24 or (gamma == 1 and out.accepted == 0)
    assert 0 < accepted < drafted  # partial acceptance: both paths exercised


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_batch4_uneven_prompts(pair, gamma, cache):
    target, drafter = pair
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=gamma, max_new_tokens=20, cache=cache)
    )
    rows = prompts(4, 64, seed=10 + gamma)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    want = [greedy_reference(target, r, 20) for r in rows]
    assert out.tokens == want
    assert dec.baseline(ids, mask).tokens == want
    # rows really accepted different lengths in some round
    assert out.accepted_at[0] != out.trials_at[0] or out.accepted < out.trials


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_batched_rows_keep_their_own_counters(pair, mode):
    """Each row of a batch keeps its own counters, and the rows' counters sum to the batch's
    (the rounds a batch plans differ from a row's alone near the budget: no equality there)."""
    target, drafter = pair
    sampling = Sampling(temperature=1.0) if mode == "sampled" else Sampling()
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=3, max_new_tokens=16, sampling=sampling)
    )
    rows = prompts(4, 64, seed=21)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask, generator=torch.Generator().manual_seed(0))
    own = out.rows()
    assert [r.tokens for r in own] == [[t] for t in out.tokens]
    for f in ("block_tokens", "row_rounds", "accepted", "trials"):
        assert sum(getattr(r, f) for r in own) == getattr(out, f)
    for f in ("accepted_at", "trials_at", "draft_lengths"):
        assert [sum(v) for v in zip(*(getattr(r, f) for r in own))] == getattr(out, f)
    assert sum(r.alpha_sum for r in own) == pytest.approx(out.alpha_sum)
    # each row was counted in the rounds it was still decoding: at least one round per
    # `gamma + 1` tokens it emitted, and every round emitted something
    for r in own:
        assert len(r.tokens[0]) <= r.block_tokens and r.row_rounds * 4 >= len(r.tokens[0])


@pytest.mark.parametrize("gamma", [3, 5])
def test_eos_inside_an_accepted_block_stops_there(pair, gamma):
    target, drafter = pair
    prompt = prompts(1, 64, seed=3)[0]
    ref = greedy_reference(target, prompt, 30)
    for cut in (4, 9):  # the EOS token's first occurrence decides where decoding must stop
        eos = ref[cut]
        want = ref[: ref.index(eos) + 1]
        cfg = DecoderConfig(gamma=gamma, max_new_tokens=30, eos_token_id=(eos,))
        dec = SpeculativeDecoder(target, drafter, cfg)
        assert dec.generate(torch.tensor([prompt])).tokens[0] == want
        # batch: one row stops early, the others go on to max_new_tokens
        rows = [prompt, *prompts(3, 64, seed=20)]
        ids, mask = left_pad(rows)
        got = dec.generate(ids, mask).tokens
        assert got == [greedy_reference(target, r, 30, (eos,)) for r in rows]


@pytest.mark.parametrize("sync_every", [1, 4, 7])
def test_target_only_batched_host_moves_stop_at_eos(pair, sync_every):
    """Target-only decoding moves tokens to the host every `host_sync_every` steps: rows that
    hit EOS between moves are still cut right after it, batch 1 and left-padded batches."""
    target, drafter = pair
    prompt = prompts(1, 64, seed=3)[0]
    ref = greedy_reference(target, prompt, 30)
    eos = ref[5]
    cfg = DecoderConfig(max_new_tokens=30, eos_token_id=(eos,), host_sync_every=sync_every)
    dec = SpeculativeDecoder(target, drafter, cfg)
    assert dec.sync_every == sync_every
    assert dec.baseline(torch.tensor([prompt])).tokens[0] == ref[: ref.index(eos) + 1]
    rows = [prompt, *prompts(3, 64, seed=20)]
    ids, mask = left_pad(rows)
    got = dec.baseline(ids, mask).tokens
    assert got == [greedy_reference(target, r, 30, (eos,)) for r in rows]


def test_differently_seeded_drafter_and_padded_vocab():
    """A drafter from another seed with an embedding padded by 8 rows is still lossless."""
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=1)
    drafter = tiny_llama(vocab=72, layers=1, hidden=32, seed=2)
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=3, max_new_tokens=16), tokenizer_len=60
    )
    for prompt in prompts(3, 60, seed=5):
        assert dec.generate(torch.tensor([prompt])).tokens[0] == greedy_reference(
            target, prompt, 16
        )


def test_round_records_match_the_output(pair):
    target, drafter = pair
    cfg = DecoderConfig(gamma=3, max_new_tokens=18, record_probs=True, sampling=Sampling(1.0))
    dec = SpeculativeDecoder(target, drafter, cfg)
    ids, mask = left_pad(prompts(3, 64, seed=7))
    out = dec.generate(ids, mask, generator=torch.Generator().manual_seed(0))
    assert len(out.rounds) == out.target_forwards
    for rec in out.rounds:
        k = rec.draft.shape[1]  # gamma, fewer only where the budget leaves no room for more
        assert 1 <= k <= 3 and rec.target_probs is not None
        assert rec.target_probs.shape == (3, k + 1, 64)
        assert torch.allclose(rec.target_probs.sum(-1), torch.ones(3, k + 1))
        left = max(18 - s for s, a in zip(rec.start, rec.active) if a)
        assert k == min(3, max(1, left - 1))
        for r in range(3):
            if not rec.active[r]:
                continue
            n, s = int(rec.accepted[r]), rec.start[r]
            emitted = [*rec.draft[r, :n].tolist(), int(rec.next_token[r])]
            assert out.tokens[r][s : s + n + 1] == emitted[: len(out.tokens[r]) - s]


def test_toy_tiny_pair_greedy_lossless(toy_tiny_pair):
    target, drafter, tok = toy_tiny_pair
    from specdistill.data.prompts import load_prompts

    texts = [
        p.text
        for p in load_prompts({"source": "toy", "toy": "toy-tiny"}, tok, default_split="test")[:4]
    ]
    rows = [tok(t).input_ids[-(24 + 9 * i) :] for i, t in enumerate(texts)]  # uneven lengths
    eos = (tok.eos_token_id,)
    for gamma in (1, 3, 5):
        cfg = DecoderConfig(gamma=gamma, max_new_tokens=16, eos_token_id=eos)
        dec = SpeculativeDecoder(target, drafter, cfg, tokenizer_len=len(tok))
        want = [greedy_reference(target, r, 16, eos) for r in rows]
        assert [dec.generate(torch.tensor([r])).tokens[0] for r in rows] == want
        ids, mask = left_pad(rows, tok.pad_token_id)
        out = dec.generate(ids, mask)
        assert out.tokens == want
        assert out.tau > 1.0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_last_round_drafts_only_what_the_budget_can_emit(pair, cache):
    """A drafter equal to the target accepts everything: 7 tokens at gamma 4 are one full round
    (4 drafts + bonus) and a round of 1 draft + bonus, not a second round of 4 drafts."""
    target, _ = pair
    dec = SpeculativeDecoder(
        target, copy.deepcopy(target), DecoderConfig(gamma=4, max_new_tokens=7, cache=cache)
    )
    prompt = prompts(1, 64, seed=3)[0]
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 7)
    assert (out.target_forwards, out.drafter_forwards, out.accepted) == (2, 5, 5)
    assert out.trials_at == [2, 1, 1, 1]
