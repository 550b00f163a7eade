"""Sequence packing (distill/train/packing.py): the packed micro-batch's loss and gradients equal
the right-padded one's, rows never overflow, and a model that lets packed sequences see each
other is refused in one line."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import packing
from specdistill.distill.train.data import Example, collate
from specdistill.distill.train.segment_attention import (
    ATTENTION,
    segments_attention,
    segments_mask,
    spans,
    supports,
)
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import shared_vocab_loss


def test_first_fit_decreasing_places_every_sequence_once_within_capacity():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        rows = packing.pack_rows(lengths, 40)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 40 for row in rows)
        # first fit: a later row's first sequence did not fit in an earlier row, whose load
        # only grew since, so any two rows' loads sum past the capacity (rows <= 2 x optimal)
        loads = [sum(lengths[i] for i in row) for row in rows]
        assert all(a + b > 40 for j, a in enumerate(loads) for b in loads[j + 1 :])


def _examples(seed: int, n: int, k: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randint(3, 60) for _ in range(rng.randint(2, 30))]
        comp = [rng.randint(3, 60) for _ in range(rng.randint(1, 20))]
        top = lp = None
        if k:
            top = [rng.sample(range(64), k) for _ in comp]
            lp = [sorted((-rng.random() * 5 for _ in range(k)), reverse=True) for _ in comp]
        out.append(Example(prompt, comp, top, lp))
    return out


def test_packed_batch_holds_each_sequence_as_collate_cuts_it():
    exs = _examples(1, 9, k=3)
    flat = collate(exs, 0, 40)
    packed = packing.collate_packed(exs, 0, 40)
    assert "attention_mask" not in packed
    assert packed["input_ids"].shape[0] < len(exs)  # several sequences share a row
    assert packed["input_ids"].shape[1] <= 40
    assert int(packed["loss_mask"].sum()) == int(flat["loss_mask"].sum())

    # the loss positions' next tokens and stored top-k, in the same multiset
    def triples(b):
        nxt = torch.roll(b["input_ids"], -1, 1)[b["loss_mask"]]
        return sorted(zip(nxt.tolist(), b["topk_ids"][b["loss_mask"]].tolist(),
                          b["topk_lp"][b["loss_mask"]].tolist()))  # fmt: skip

    assert triples(packed) == triples(flat)
    pos = packed["position_ids"]
    starts = (pos == 0).sum().item()
    assert starts >= len(exs)  # every sequence (and each row's padding) restarts at 0


def _trainer(distill_cfg, tmp_path, data, *overrides):
    from specdistill.distill.train import stage

    cfg = distill_cfg(tmp_path, f"data.path={data}", "max_seq_len=200", "micro_batch_size=6",
                      "eval.source=path", f"eval.path={data}", "eval.limit=1", *overrides)  # fmt: skip
    return stage.prepare(cfg)


@pytest.mark.parametrize("stored", [True, False])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("layout", ["one_row", "rows", "rows_block_mask"])
def test_packed_loss_and_gradients_equal_the_padded_ones(
    distill_cfg, tmp_path, seqkd_dir, seqkd_topk_dir, stored, masked, layout
):
    """Stored top-k or the live target, the masked head or the full logits, and each packed
    layout: the micro-batch in one row or in rows of max_seq_len, attended span by span
    (train/segment_attention.py, what the stage sets for these models) or under sdpa's block
    mask. One micro-batch's loss packed equals it right-padded to 1e-5, and so do the
    drafter's gradients."""
    data = seqkd_topk_dir if stored else seqkd_dir
    tr = _trainer(distill_cfg, tmp_path, data, "pack_sequences=true")
    assert tr.topk == stored and (tr.target is None) == stored
    assert tr.pack_one_row and tr.model.config._attn_implementation == ATTENTION
    if layout == "rows_block_mask":
        for m in (tr.model, tr.target):
            if m is not None:
                m.set_attn_implementation("sdpa")
    rows = [tr.train_examples[i] for i in range(6)]  # prompts cut to mixed lengths
    exs = [Example(e.prompt_ids[7 * i :], e.completion_ids, e.topk_ids, e.topk_logprobs)
           for i, e in enumerate(rows)]  # fmt: skip
    packed = packing.collate_packed(exs, tr.tok.pad_token_id, 200, layout == "one_row")
    assert packed["input_ids"].shape[0] == 1 or layout != "one_row"
    results = []
    for batch in (collate(exs, tr.tok.pad_token_id, 200), packed):
        tr.model.zero_grad(set_to_none=True)
        n = int(batch["loss_mask"].sum())
        loss = shared_vocab_loss(tr, batch, False, masked, "fkl", 0.5, n)
        loss.backward()
        grads = [p.grad.clone() for p in tr.model.parameters() if p.grad is not None]
        results.append((float(loss.detach()), grads, batch["input_ids"].numel()))
    (l0, g0, cells0), (l1, g1, cells1) = results
    assert cells1 < cells0  # the packed grid is smaller
    assert abs(l0 - l1) <= 1e-5 * max(1.0, abs(l0))
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_spans_start_wherever_positions_do_not_follow_on():
    assert spans([0, 1, 2, 0, 1, 0, 0, 1]) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert spans([4, 5, 6]) == [(0, 3)]
    assert spans([0, 1, 5, 6]) == [(0, 2), (2, 4)]


def test_span_attention_equals_a_dense_block_diagonal_causal_softmax():
    """Brute force: scores over the whole row, every pair outside a sequence's own causal
    triangle set to -inf, softmax, times V (grouped-query heads repeated); and a call with a
    padding mask or a cache offset is sdpa's own."""
    gen = torch.Generator().manual_seed(0)
    b, h, h_kv, n, d = 2, 4, 2, 11, 8
    q = torch.randn(b, h, n, d, generator=gen)
    k = torch.randn(b, h_kv, n, d, generator=gen)
    v = torch.randn(b, h_kv, n, d, generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = h // h_kv, True, False
    out, _ = segments_attention(module, q, k, v, None, scaling=0.3, position_ids=positions)
    kk, vv = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)
    scores = (q @ kk.transpose(-1, -2)) * 0.3
    seq = torch.stack([torch.tensor([a for a, (s, e) in enumerate(spans(row)) for _ in range(e - s)])
                       for row in positions.tolist()])  # fmt: skip
    same = seq[:, :, None] == seq[:, None, :]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~(same & causal)[:, None], float("-inf"))
    want = (scores.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert segments_mask(b, n, n) is None  # no padding, no offset: the spans decide
    padded = torch.ones(b, n, dtype=torch.bool)
    padded[1, -2:] = False
    mask = segments_mask(b, n, n, attention_mask=padded)
    assert mask is not None and mask.shape == (b, 1, n, n)


def test_span_attention_is_set_only_where_it_computes_what_sdpa_does():
    """A plain-head model on CPU with sdpa: yes. Another device (a GPU keeps transformers' own
    packed path), a sliding window or an architecture outside PLAIN_HEAD: no."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    llama = LlamaForCausalLM(LlamaConfig(**small, attn_implementation="sdpa"))
    assert supports(llama)
    with torch.device("meta"):
        assert not supports(LlamaForCausalLM(LlamaConfig(**small, attn_implementation="sdpa")))
    windowed = Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                           attn_implementation="sdpa")  # fmt: skip
    assert not supports(Qwen2ForCausalLM(windowed))
    assert supports(Qwen2ForCausalLM(Qwen2Config(**small, attn_implementation="sdpa")))
    other = torch.nn.Linear(2, 2)
    other.config = SimpleNamespace(model_type="gpt2", _attn_implementation="sdpa")
    assert not supports(other)


def test_a_model_that_mixes_packed_sequences_is_refused():
    class Leaky(torch.nn.Module):
        """Logits from a running sum over every earlier token: no restart at position 0."""

        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 50)

        def forward(self, input_ids, position_ids=None, use_cache=None, attention_mask=None):
            class Out:
                logits = self.emb(input_ids).cumsum(1)

            return Out()

    with pytest.raises(ConfigError, match=r"^pack_sequences=true: the drafter \(leaky\) lets"):
        packing.check_isolation(Leaky(), "drafter", "leaky", 50)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["drafting=parallel"], r"pack_sequences=true with drafting=parallel"),
        (["pack_sequences=maybe"], r"pack_sequences='maybe': use true or false"),
    ],
)
def test_settings_packing_cannot_run_are_one_line(distill_cfg, tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        TrainSettings.from_cfg(distill_cfg(tmp_path, "pack_sequences=true", *overrides))


def test_a_packed_run_trains_step_for_step_like_the_padded_one(
    distill_cfg, tmp_path, seqkd_topk_dir
):
    """The stage end to end: each step's loss packed (one row, span by span) equals the padded
    run's, and the drafter it writes loads with the stock attention (the span attention is a
    training-time setting, never saved)."""
    from specdistill.distill.train import stage

    common = (f"data.path={seqkd_topk_dir}", "max_steps=3", "eval_every=3", "micro_batch_size=6")
    padded = stage.run(distill_cfg(tmp_path / "padded", *common))
    packed = stage.run(distill_cfg(tmp_path / "packed", *common, "pack_sequences=true"))
    assert [h["tokens"] for h in packed.history] == [h["tokens"] for h in padded.history]
    for a, b in zip(padded.history, packed.history, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    config = (tmp_path / "packed" / "best" / "config.json").read_text()
    assert ATTENTION not in config
