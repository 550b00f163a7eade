"""Parallel-drafter training (distill.parallel): the packed forward equals separate forwards, and
the masked-position loss equals its brute-force per-position computation.

p = target, q = drafter. Brute force: for every anchor j and depth d, a separate cache-free
drafter forward over x_1..x_j + (d-1) masks, compared with the target's distribution at real
position j+d-1 from a forward over the real sequence.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.losses import distill_loss, token_divergence
from specdistill.distill.parallel import (
    accepted_length,
    check_parallel_config,
    choose_anchors,
    gather_positions,
    pack_parallel,
    packed_forward,
    resolve_train_mask_token,
)
from tests.conftest import tiny_llama

MASK, K = 1, 4


def batch():
    """Two right-padded rows (prompt 3 / 5 tokens, completions 7 / 4 tokens)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, 64, (10,), generator=g), torch.randint(2, 64, (9,), generator=g)]
    starts = [3, 5]
    t = max(len(r) for r in rows)
    ids = torch.zeros(2, t, dtype=torch.long)
    att = torch.zeros(2, t, dtype=torch.long)
    lm = torch.zeros(2, t, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = r
        att[i, : len(r)] = 1
        lm[i, s - 1 : len(r) - 1] = True
    return ids, att, lm


def test_anchors_are_completion_positions_with_a_depth2_label():
    _, _, lm = batch()
    a = choose_anchors(lm, 100)
    for r in range(2):
        got = [int(j) for j in a[r] if j >= 0]
        assert got == [j for j in range(lm.shape[1] - 1) if lm[r, j] and lm[r, j + 1]]
    few = choose_anchors(lm, 2, torch.Generator().manual_seed(1))
    assert few.shape == (2, 2) and bool((few >= 0).all())
    assert all(bool(lm[r, few[r]].all()) for r in range(2))


@torch.inference_mode()
def test_packed_forward_equals_separate_forwards():
    model = tiny_llama(vocab=64, layers=2, hidden=32, seed=3)
    ids, att, lm = batch()
    anchors = choose_anchors(lm, 100)
    packed = pack_parallel(ids, att, lm, anchors, K, MASK, 0.5)
    logits = packed_forward(model, packed)
    t = ids.shape[1]
    ar = model(input_ids=ids, attention_mask=att).logits
    real = att.bool()
    torch.testing.assert_close(logits[:, :t][real], ar[real], atol=1e-5, rtol=1e-4)
    checked = 0
    for r in range(2):
        for n in range(t, packed["input_ids"].shape[1]):
            a, d = (n - t) // (K - 1), int(packed["depth"][r, n])
            j = int(anchors[r, a])
            if j < 0:
                continue
            x = torch.tensor([[*ids[r, : j + 1].tolist(), *[MASK] * (d - 1)]])
            want = model(x).logits[0, -1]
            torch.testing.assert_close(logits[r, n], want, atol=1e-5, rtol=1e-4)
            assert int(packed["position_ids"][r, n]) == j + d - 1
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("divergence", ["fkl", "rkl", "tvd", "jsd"])
def test_masked_position_loss_matches_brute_force(divergence):
    drafter = tiny_llama(vocab=64, layers=1, hidden=32, seed=4)
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=5)
    ids, att, lm = batch()
    anchors = choose_anchors(lm, 100)
    decay = 0.7
    packed = pack_parallel(ids, att, lm, anchors, K, MASK, decay)
    q = packed_forward(drafter, packed)
    p = target(input_ids=ids, attention_mask=att).logits.detach()
    loss = distill_loss(
        q,
        packed["weight"] > 0,
        weights=packed["weight"],
        target_logits=gather_positions(p, packed["label_pos"]),
        divergence=divergence,
        beta=0.3,
        num_tokens=packed["weight"].sum(),
        chunk_size=5,
    )
    # brute force: one separate forward per (row, anchor or real position, depth)
    total = weight = 0.0
    with torch.no_grad():
        for r in range(2):
            chains = [(j, 1) for j in range(ids.shape[1]) if lm[r, j]]
            chains += [(int(j), d) for j in anchors[r] if j >= 0 for d in range(2, K + 1)]
            for j, d in chains:
                if j + d - 1 >= ids.shape[1] or not lm[r, j + d - 1]:
                    continue
                x = torch.tensor([[*ids[r, : j + 1].tolist(), *[MASK] * (d - 1)]])
                lq = torch.log_softmax(drafter(x).logits[0, -1].float(), -1)
                lp = torch.log_softmax(p[r, j + d - 1].float(), -1)
                w = decay ** (d - 1)
                total += w * float(token_divergence(divergence, lp, lq, 0.3))
                weight += w
    assert float(loss.detach()) == pytest.approx(total / weight, rel=1e-4)
    loss.backward()  # gradients reach the drafter through the packed forward
    assert drafter.model.embed_tokens.weight.grad is not None


def test_parallel_config_errors_name_the_field():
    ok = {"depth": 8, "anchors": 16, "decay": 0.8}
    check_parallel_config(ok)
    check_parallel_config(ok | {"miss_weight": 4})
    bad_values = (("depth", 1), ("anchors", 0), ("decay", 1.5), ("depth", True),
                  ("miss_weight", 0), ("miss_weight", -2.0), ("miss_weight", "x"))  # fmt: skip
    for key, bad in bad_values:
        with pytest.raises(ConfigError, match=f"parallel.{key}="):
            check_parallel_config(ok | {key: bad})


class _Tok:
    """A tokenizer's special-token roles, as `transformers` exposes them."""

    def __init__(self, pad, eos, bos=None, unk=None, special=(), n=100) -> None:
        from types import SimpleNamespace

        self.pad_token_id, self.eos_token_id, self.bos_token_id, self.unk_token_id = (
            pad,
            eos,
            bos,
            unk,
        )
        self.all_special_ids = [i for i in (pad, eos, bos, unk) if i is not None]
        self.added_tokens_decoder = {i: SimpleNamespace(special=True) for i in special}
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_the_mask_token_is_never_the_eos_token():
    assert resolve_train_mask_token("auto", _Tok(pad=3, eos=2, bos=1)) == 3  # a pad of its own
    # SmolLM2: pad = eos = <|im_end|> (2), bos 1, unk 0, specials 3..16: the last spare special
    smollm2 = _Tok(pad=2, eos=2, bos=1, unk=0, special=range(17))
    assert resolve_train_mask_token("auto", smollm2) == 16
    assert resolve_train_mask_token(None, _Tok(pad=None, eos=2, special=(0, 2, 5))) == 5
    with pytest.raises(ConfigError, match="parallel.mask_token_id=auto needs a pad token"):
        resolve_train_mask_token("auto", _Tok(pad=2, eos=2, bos=1, special=(1, 2)))
    assert resolve_train_mask_token(7, smollm2) == 7
    with pytest.raises(ConfigError, match="parallel.mask_token_id=100 is past"):
        resolve_train_mask_token(100, smollm2)


def test_accepted_length_brute_force():
    a = [0.9, 0.5, 0.2]
    want = 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2
    assert accepted_length(a) == pytest.approx(want)


@pytest.mark.slow  # Seq-KD set, training, per-depth evaluation
def test_parallel_conversion_raises_acceptance_past_depth1(distill_cfg, tmp_path, seqkd_dir):
    """The distill stage with drafting=parallel: mask depths learn (held-out acceptance at
    depths >= 2 rises), best/ is picked by accepted length and carries its mask token."""
    import json

    from transformers import AutoConfig

    from specdistill.distill.train import stage as train

    cfg = distill_cfg(
        tmp_path / "run", f"data.path={seqkd_dir}", "drafting=parallel", "parallel.depth=4",
        "max_steps=12", "eval_every=6", "eval.source=target", "eval.sampling.temperature=0",
    )  # fmt: skip
    res = train.run(cfg)
    par = res.parallel
    assert par is not None and par["depth"] == 4 and len(par["alpha_at_best"]) == 4
    assert sum(par["alpha_at_best"][1:]) > sum(par["alpha_at_before"][1:]) + 0.05, par
    assert par["accepted_length_best"] > par["accepted_length_before"]
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["parallel"]["mask_token_id"] == par["mask_token_id"]
    config = AutoConfig.from_pretrained(res.drafter_path)
    assert config.mask_token_id == par["mask_token_id"]
    with pytest.raises(ConfigError, match="parallel.depth=1"):
        train.run(distill_cfg(tmp_path / "bad", "drafting=parallel", "parallel.depth=1"))


def test_after_miss_factors_mark_contexts_that_end_just_after_a_drafter_miss():
    """Brute force over a packed batch: real position i and every chain slot anchored at i get
    the weight exactly when the drafter's argmax at real position i - 1 (a labelled one) was not
    the target's; unlabelled positions never count as misses; `reweigh` keeps the total."""
    from specdistill.distill.parallel import after_miss_factors, reweigh

    ids, att, lm = batch()
    anchors = choose_anchors(lm, 100)
    packed = pack_parallel(ids, att, lm, anchors, K, MASK, 0.8)
    b, n = packed["weight"].shape
    t = ids.shape[1]
    g = torch.Generator().manual_seed(5)
    target_top = torch.randint(0, 4, (b, n), generator=g)
    drafter_top = torch.randint(0, 4, (b, n), generator=g)  # about a quarter agree
    got = after_miss_factors(packed, drafter_top, target_top, 3.0)
    for r in range(b):
        missed = [
            bool(lm[r, i]) and int(drafter_top[r, i]) != int(target_top[r, i]) for i in range(t)
        ]
        for i in range(t):
            assert float(got[r, i]) == (3.0 if i > 0 and missed[i - 1] else 1.0)
        for slot in range(n - t):
            j = int(anchors[r, slot // (K - 1)])
            want = 3.0 if j > 0 and missed[j - 1] else 1.0
            assert float(got[r, t + slot]) == want, (r, slot, j)
    assert float((got == 3.0).sum()) > 0 and float((got == 1.0).sum()) > 0
    w = reweigh(packed["weight"], got)
    torch.testing.assert_close(w.sum(), packed["weight"].sum())
    on = packed["weight"] > 0
    ratio = (w[on] / packed["weight"][on]) / got[on]  # one common scale
    torch.testing.assert_close(ratio, ratio[0].expand_as(ratio))
    assert bool((w[~on] == 0).all())
    flat = torch.ones_like(got)
    assert torch.equal(reweigh(packed["weight"], flat), packed["weight"])


def test_miss_weight_gives_the_same_weights_with_the_masked_and_the_full_head():
    """The stage's packed weights with `parallel.miss_weight`: the masked head (the kept
    positions' logits row, and hidden states + head in chunks) and the full packed logits find
    the same misses, so the same weights reach the loss."""
    import contextlib
    from types import SimpleNamespace

    from specdistill.distill.train import parallel_drafting

    model = tiny_llama(vocab=64, layers=2, hidden=32, seed=3)
    ids, att, lm = batch()
    packed = pack_parallel(ids, att, lm, choose_anchors(lm, 100), K, MASK, 0.8)
    target = tiny_llama(vocab=64, layers=1, hidden=16, seed=9)

    def trainer(chunked):
        par = SimpleNamespace(objective="token", miss_weight=4.0, cat_mix=1.0)
        return SimpleNamespace(
            s=SimpleNamespace(parallel=par), model=model, vocab=64, chunked=chunked, topk=False,
            target=target, accelerator=SimpleNamespace(autocast=contextlib.nullcontext),
        )  # fmt: skip

    b = {"input_ids": ids, "attention_mask": att}
    with torch.no_grad():
        full = parallel_drafting.packed_logits_and_targets(trainer(False), b, packed, False, False)[
            2
        ]
        row = parallel_drafting.packed_logits_and_targets(trainer(False), b, packed, False, True)[2]
        chunk = parallel_drafting.packed_logits_and_targets(trainer(True), b, packed, False, True)[
            2
        ]
    keep = packed["weight"] > 0
    assert not torch.equal(full["weights"], packed["weight"])  # some contexts were reweighed
    torch.testing.assert_close(full["weights"][keep][None], row["weights"])
    torch.testing.assert_close(full["weights"][keep][None], chunk["weights"])
