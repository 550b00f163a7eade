"""The self-query sampler whose rows restart as their samples end (data/query_stream.py): each
sample is what decoding it alone gives, through restarts and cache trims; samples come in the
order they started; the same seed gives the same stream; other caches keep the fixed batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdistill.data import query_stream as qs
from specdistill.data.sampling import Sampling

HEADER = [5, 17, 33, 2, 9]


@pytest.fixture
def target(toy_tiny_pair):
    return toy_tiny_pair[0]


def _stops(model) -> set[int]:
    """The tokens the model puts most of its mass on after the header: samples end often."""
    with torch.no_grad():
        logits = model(torch.tensor([HEADER])).logits[0, -1]
    return set(logits.topk(6).indices.tolist())


def _stream(model, stops, rows=4, max_tokens=9, seed=0, draw=None):
    gen = torch.Generator().manual_seed(seed)
    draw = draw or qs.sampling_draw(Sampling(temperature=1.0), gen)
    return qs.stream_samples(model, HEADER, max_tokens, stops, rows, draw)


@pytest.mark.usefixtures("one_thread")
def test_each_sample_is_what_decoding_it_alone_gives(target, monkeypatch):
    monkeypatch.setattr(qs, "TRIM", 2)  # trim the cache often
    stops = _stops(target)
    samples = list(itertools.islice(_stream(target, stops), 40))
    ended = [s for s in samples if s.ids[-1] in stops]
    assert 5 < len(ended) < 40  # both kinds, so rows restart at different steps
    for s in samples:
        assert all(t not in stops for t in s.ids[:-1])
        assert s.ids[-1] in stops or len(s.ids) == 9
        with torch.no_grad():
            logits = target(torch.tensor([HEADER + s.ids])).logits[0]
        full = torch.log_softmax(logits[len(HEADER) - 1 : -1].float(), dim=-1)
        expected = full.gather(1, torch.tensor(s.ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=2e-4, rtol=0)


@pytest.mark.usefixtures("one_thread")
def test_samples_come_in_the_order_they_started(target):
    draws: list[list[int]] = []
    gen = torch.Generator().manual_seed(3)
    inner = qs.sampling_draw(Sampling(temperature=1.0), gen)

    def draw(logits):
        out = inner(logits)
        draws.append(out.tolist())
        return out

    samples = list(itertools.islice(_stream(target, _stops(target), draw=draw), 12))
    assert [s.ids[0] for s in samples[:4]] == draws[0]  # the four rows' first samples, in order


@pytest.mark.usefixtures("one_thread")
def test_the_same_seed_gives_the_same_stream(target):
    stops = _stops(target)
    one = [s.ids for s in itertools.islice(_stream(target, stops, seed=1), 16)]
    two = [s.ids for s in itertools.islice(_stream(target, stops, seed=1), 16)]
    other = [s.ids for s in itertools.islice(_stream(target, stops, seed=2), 16)]
    assert one == two and one != other


def test_top_k_one_draws_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    draw = qs.sampling_draw(Sampling(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))
    assert draw(logits).tolist() == [1, 0]


def test_a_sliding_window_cache_keeps_the_fixed_batch(target):
    from transformers import MistralConfig, MistralForCausalLM

    from specdistill.data import self_queries as sq

    config = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=4)  # fmt: skip
    windowed = MistralForCausalLM(config).eval()
    assert qs.supported(target) and not qs.supported(windowed)
    s = sq.SelfSettings(count=4, batch_size=3, max_query_tokens=5)
    rows = sq.model_sampler(windowed, [1, 2, 3], s, {7}, 0)(0)
    assert len(rows) == 3 and all(len(r) <= 5 for r in rows)
