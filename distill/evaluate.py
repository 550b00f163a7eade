"""Held-out evaluation of the drafter: expected acceptance alpha and greedy agreement.

alpha = mean over completion positions of sum_x min(p, q) (target p, drafter q), the chance a
sampled draft token is accepted; greedy agreement = share of positions where argmax q ==
argmax p, what greedy speculative decoding accepts. DESIGN.md: greedy figures saturate on a
weak target, so alpha on sampled continuations should be reported beside them.
"""

from __future__ import annotations

import torch

from specdistill.distill.losses import per_token_acceptance


@torch.no_grad()
def evaluate(
    drafter,
    target,
    batches: list[dict[str, torch.Tensor]],
    *,
    vocab: int,
    temperature: float = 1.0,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """alpha and greedy agreement over the batches' masked positions.

    With `target=None` the batches must carry the target's stored top-k log-probs: alpha is
    then sum over the top-k of min(p, q), a lower bound (the rest bucket's mass is left out),
    and greedy agreement uses the stored top-1.
    """
    was_training = drafter.training
    drafter.eval()
    acc_sum, agree, count = 0.0, 0, 0
    for batch in batches:
        ids = batch["input_ids"].to(device)
        att = batch["attention_mask"].to(device)
        mask = batch["loss_mask"].to(device)
        q_logits = drafter(input_ids=ids, attention_mask=att).logits[..., :vocab].float()
        if target is not None:
            p_logits = target(input_ids=ids, attention_mask=att).logits[..., :vocab].float()
            acc = per_token_acceptance(p_logits, q_logits, temperature)
            p_top = p_logits.argmax(-1)
        else:
            tk_ids = batch["topk_ids"].to(device)
            lq = torch.log_softmax(q_logits, -1).gather(-1, tk_ids)
            acc = torch.minimum(batch["topk_lp"].to(device), lq).exp().sum(-1)
            p_top = tk_ids[..., 0]
        acc_sum += float(acc[mask].double().sum())
        agree += int((q_logits.argmax(-1) == p_top)[mask].sum())
        count += int(mask.sum())
    drafter.train(was_training)
    if count == 0:
        return {"alpha": float("nan"), "greedy_agreement": float("nan"), "tokens": 0}
    return {"alpha": acc_sum / count, "greedy_agreement": agree / count, "tokens": count}
