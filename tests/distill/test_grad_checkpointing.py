"""`gradient_checkpointing`: the drafter's layers recompute their activations in backward; the
loss and gradients are those of a run without it (frozen embeddings included, where a
reentrant checkpoint would have cut the gradient)."""

from __future__ import annotations

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train.data import collate
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import shared_vocab_loss


def _loss_and_grads(distill_cfg, tmp_path, data, *overrides):
    from specdistill.distill.train import stage

    cfg = distill_cfg(tmp_path, f"data.path={data}", "eval.source=path", f"eval.path={data}",
                      "eval.limit=1", *overrides)  # fmt: skip
    tr = stage.prepare(cfg)
    batch = collate([tr.train_examples[i] for i in range(4)], tr.tok.pad_token_id, 96)
    n = int(batch["loss_mask"].sum())
    loss = shared_vocab_loss(tr, batch, False, True, "fkl", 0.5, n)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None}
    return tr, float(loss.detach()), grads


@pytest.mark.parametrize("freeze", ["true", "false"])
def test_checkpointed_gradients_equal_the_plain_ones(distill_cfg, tmp_path, seqkd_topk_dir, freeze):
    plain, l0, g0 = _loss_and_grads(
        distill_cfg, tmp_path / "a", seqkd_topk_dir, f"freeze_embeddings={freeze}"
    )
    ckpt, l1, g1 = _loss_and_grads(
        distill_cfg, tmp_path / "b", seqkd_topk_dir, f"freeze_embeddings={freeze}",
        "gradient_checkpointing=true",
    )  # fmt: skip

    def on(model) -> bool:
        return (
            getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
        )

    assert on(ckpt.model) and not on(plain.model)
    assert l0 == pytest.approx(l1, rel=1e-6)
    assert g0.keys() == g1.keys() and any("layers" in k for k in g0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7)


def test_bad_gradient_checkpointing_is_one_line(distill_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"^gradient_checkpointing='often': use true or false"):
        TrainSettings.from_cfg(distill_cfg(tmp_path, "gradient_checkpointing=often"))
