"""Sequence packing (distill/train/packing.py): the packed micro-batch's loss and gradients equal
the right-padded one's, rows never overflow, and a model that lets packed sequences see each
other is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import packing
from specdistill.distill.train.batch_loss import shared_vocab_loss
from specdistill.distill.train.data import Example, collate
from specdistill.distill.train.settings import TrainSettings


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
def test_packed_loss_and_gradients_equal_the_padded_ones(
    distill_cfg, tmp_path, seqkd_dir, seqkd_topk_dir, stored, masked
):
    """Stored top-k or the live target, the masked head or the full logits: one micro-batch's
    loss packed equals it right-padded to 1e-5, and so do the drafter's gradients."""
    data = seqkd_topk_dir if stored else seqkd_dir
    tr = _trainer(distill_cfg, tmp_path, data, "pack_sequences=true")
    assert tr.topk == stored and (tr.target is None) == stored
    rows = [tr.train_examples[i] for i in range(6)]  # prompts cut to mixed lengths
    exs = [Example(e.prompt_ids[7 * i :], e.completion_ids, e.topk_ids, e.topk_logprobs)
           for i, e in enumerate(rows)]  # fmt: skip
    results = []
    for batch in (collate(exs, tr.tok.pad_token_id, 200),
                  packing.collate_packed(exs, tr.tok.pad_token_id, 200)):  # fmt: skip
        tr.model.zero_grad(set_to_none=True)
        n = int(batch["loss_mask"].sum())
        loss = shared_vocab_loss(tr, batch, None, False, masked, "fkl", 0.5, n, 1.0)
        loss.backward()
        grads = [p.grad.clone() for p in tr.model.parameters() if p.grad is not None]
        results.append((float(loss.detach()), grads, batch["input_ids"].numel()))
    (l0, g0, cells0), (l1, g1, cells1) = results
    assert cells1 < cells0  # the packed grid is smaller
    assert abs(l0 - l1) <= 1e-5 * max(1.0, abs(l0))
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


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
