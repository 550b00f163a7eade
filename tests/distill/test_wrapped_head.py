"""The masked head and the chunked loss through a DDP wrapper (train/logits.final_hidden): the
wrapper runs its own forward (so its gradient sync is prepared) with the head on no position,
and the hidden states, logits, loss and gradients equal the bare model's exactly.

One process (world size 1, gloo) here; 2 processes x 1 micro-batch against 1 x 2 are
tests/distill/test_multiprocess.py and, for ZeRO-2/3, test_deepspeed.py (slow)."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from specdistill.distill.head_loss import fused_distill_loss
from specdistill.distill.losses import distill_loss
from specdistill.distill.train.logits import (
    causal_lm,
    final_hidden,
    has_plain_head,
    masked_head_input,
    masked_logits,
)


@pytest.fixture
def gloo_world():
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this worker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(tok):
    texts = ["def add(a, b):\n    return a + b\n", "import os\n"]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc.attention_mask.bool().clone()
    mask[:, :2] = False  # the loss reads completion positions only
    return enc.input_ids, enc.attention_mask, mask


def test_through_ddp_hidden_logits_loss_and_grads_equal_the_bare_model(gloo_world, toy_tiny_pair):
    target, drafter, tok = toy_tiny_pair
    bare = copy.deepcopy(drafter).float().train()
    wrapped = DistributedDataParallel(copy.deepcopy(drafter).float().train())
    assert causal_lm(wrapped) is wrapped.module and causal_lm(bare) is bare
    assert has_plain_head(wrapped)
    ids, att, mask = _batch(tok)
    inputs = {"input_ids": ids, "attention_mask": att}
    h_bare, h_wrapped = final_hidden(bare, inputs), final_hidden(wrapped, inputs)
    assert torch.equal(h_bare, h_wrapped)
    assert torch.equal(h_bare, bare(**inputs, output_hidden_states=True).hidden_states[-1])
    vocab = len(tok)
    with torch.no_grad():
        p = target(**inputs).logits[..., :vocab][mask][None]
    m = torch.ones(p.shape[:2], dtype=torch.bool)
    for model in (bare, wrapped):
        q = masked_logits(model, ids, att, mask, vocab)[None]
        assert torch.allclose(q, bare(**inputs).logits[..., :vocab][mask][None], atol=1e-5)
        loss = distill_loss(q, m, divergence="fkl", target_logits=p, num_tokens=m.sum())
        loss.backward()
    for (name, a), (_, b) in zip(bare.named_parameters(), wrapped.module.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_the_chunked_loss_through_ddp_equals_the_bare_model(gloo_world, toy_tiny_pair):
    target, drafter, tok = toy_tiny_pair
    bare = copy.deepcopy(drafter).float().train()
    wrapped = DistributedDataParallel(copy.deepcopy(drafter).float().train())
    ids, att, mask = _batch(tok)
    vocab = len(tok)
    with torch.no_grad():
        p = target(input_ids=ids, attention_mask=att).logits[..., :vocab][mask]
    losses = []
    for model in (bare, wrapped):
        head = masked_head_input(model, ids, att, mask, vocab)
        m = torch.ones(head.hidden.shape[:1], dtype=torch.bool)
        loss = fused_distill_loss(
            head, m, divergence="jsd", beta=0.5, target_logits=p, num_tokens=m.sum()
        )
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    for (name, a), (_, b) in zip(bare.named_parameters(), wrapped.module.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
