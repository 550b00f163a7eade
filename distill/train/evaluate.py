"""Held-out evaluation of the drafter: expected decode-time acceptance in the serving mode.

Target p, drafter q. At every completion position the probability that speculative decoding
accepts the drafted token is exactly
  greedy serving:   [argmax q == argmax p]
  sampling serving: sum_x min(P, Q), P and Q being p and q after the serving temperature /
                    top-k / top-p (applied identically to both, as the decoder does).
`alpha` is the mean of that over the batches' masked positions. Measured on the target's own
continuations of held-out prompts (greedy continuations for greedy serving, sampled at the
serving temperature for sampling), it is what the validate stage's alpha estimates, so the
distill stage picks `best/` by it (DistillSpec: the right figure depends on the decoding mode).
"""

from __future__ import annotations

import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import expected_alpha, probs_from_logits
from specdistill.distill.parallel import (
    acceptance_by_depth,
    accepted_length,
    choose_anchors,
    gather_positions,
    pack_parallel,
    packed_forward,
    round_accepted,
)
from specdistill.distill.train.logits import masked_logits


def serving_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: Sampling
) -> torch.Tensor:
    """Per-position acceptance probability of a drafted token (target p, drafter q), (...,)."""
    if sampling.greedy:  # no one-hot (B, T, V) tensors: compare the argmaxes
        return (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
    return expected_alpha(
        probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
    )


def _stored_topk_ok(sampling: Sampling) -> bool:
    """Stored top-k log-probs are the target's at temperature 1 with nothing cut."""
    return sampling.greedy or (
        sampling.temperature == 1.0 and sampling.top_k == 0 and sampling.top_p == 1.0
    )


@torch.no_grad()
def evaluate(
    drafter,
    target,
    batches: list[dict[str, torch.Tensor]],
    *,
    vocab: int,
    sampling: Sampling,
    device: torch.device | str = "cpu",
    head_ids: torch.Tensor | None = None,
) -> dict[str, float]:
    """alpha (acceptance in the `sampling` mode) and greedy agreement over masked positions.

    `head_ids`: q as our decoder drafts with a draft vocabulary (decode.draft_vocab), 0
    outside those tokens; for a drafter trained on it (`draft_vocab_train`), whose logits
    outside the subset were never trained down. That is the TLI acceptance with the draft
    vocabulary as I (intersection.py), the figure its loss trains for: at T = 1, 1 - the
    treatment-(b) TVD (tests/distill/test_draft_vocab_train.py); greedy, a position whose target
    argmax is outside never agrees (those `tli_mask_unreachable` drops from the loss).

    With `target=None` the batches must carry the target's stored top-k log-probs (at T=1):
    alpha is then sum over the top-k of min(p, q), a lower bound (the rest bucket's mass is
    left out), and greedy agreement uses the stored top-1.
    """
    if target is None and not _stored_topk_ok(sampling):
        raise ConfigError(
            f"eval.sampling={sampling.as_dict()}: stored top-k log-probs are at temperature 1 "
            "with nothing cut; load the target (eval.source=target or reference) or evaluate "
            "at eval.sampling.temperature=0 or 1 (top_k 0, top_p 1)"
        )
    was_training = drafter.training
    drafter.eval()
    acc_sum, agree, count = 0.0, 0, 0
    for batch in batches:
        ids = batch["input_ids"].to(device)
        att = batch["attention_mask"].to(device)
        mask = batch["loss_mask"].to(device)
        # [N, V] rows of the masked positions only (the head skips prompt and padding)
        q_logits = masked_logits(drafter, ids, att, mask, vocab).float()
        if head_ids is not None:
            q_logits = torch.full_like(q_logits, torch.finfo(q_logits.dtype).min).index_copy_(
                -1, head_ids, q_logits.index_select(-1, head_ids)
            )
        if target is not None:
            p_logits = masked_logits(target, ids, att, mask, vocab).float()
            acc = serving_acceptance(p_logits, q_logits, sampling)
            p_top = p_logits.argmax(-1)
        else:
            acc, p_top = _stored_acceptance(q_logits, batch, mask, sampling, device)
        acc_sum += float(acc.double().sum())
        agree += int((q_logits.argmax(-1) == p_top).sum())
        count += int(mask.sum())
    drafter.train(was_training)
    if count == 0:
        return {"alpha": float("nan"), "greedy_agreement": float("nan"), "tokens": 0}
    return {"alpha": acc_sum / count, "greedy_agreement": agree / count, "tokens": count}


def _stored_acceptance(
    q_logits: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor,
    sampling: Sampling, device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(acceptance per masked position, the target's top-1) from the stored top-k at T = 1:
    greedy, q's argmax against the stored top-1; else sum over the top-k of min(p, q)."""
    tk_ids = batch["topk_ids"].to(device)[mask]
    p_top = tk_ids[..., 0]
    if sampling.greedy:
        return (q_logits.argmax(-1) == p_top).float(), p_top
    lq = torch.log_softmax(q_logits, -1).gather(-1, tk_ids)
    return torch.minimum(batch["topk_lp"].to(device)[mask], lq).exp().sum(-1), p_top


@torch.no_grad()
def evaluate_parallel(
    drafter,
    target,
    batches: list[dict[str, torch.Tensor]],
    *,
    vocab: int,
    sampling: Sampling,
    depth: int,
    mask_token_id: int,
    device: torch.device | str = "cpu",
) -> dict:
    """`evaluate` for a parallel drafter: acceptance at every draft depth 1..depth, with a mask
    chain at every completion anchor (distill.parallel), and the expected accepted drafts per
    round those imply (`accepted_length`, what best/ follows). Needs the target in the loop."""
    if target is None:
        raise ConfigError(
            "drafting=parallel evaluates every draft depth with the target: use eval.source="
            "reference or target (not stored top-k only)"
        )
    was_training = drafter.training
    drafter.eval()
    sums, counts = [0.0] * depth, [0] * depth
    agree, rounds, n_rounds = 0, 0.0, 0
    for batch in batches:
        b = {k: v.to(device) for k, v in batch.items()}
        anchors = choose_anchors(b["loss_mask"].cpu(), b["loss_mask"].shape[1]).to(device)
        packed = pack_parallel(
            b["input_ids"], b["attention_mask"], b["loss_mask"], anchors, depth, mask_token_id, 1.0
        )
        q = packed_forward(drafter, packed)[..., :vocab].float()
        p_real = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        p = gather_positions(p_real[..., :vocab].float(), packed["label_pos"])
        acc = serving_acceptance(p, q, sampling)
        means, n = acceptance_by_depth(acc, packed, depth)
        r_sum, r_n = round_accepted(acc, packed)
        rounds, n_rounds = rounds + r_sum, n_rounds + r_n
        for d in range(depth):
            sums[d] += means[d] * n[d]
            counts[d] += n[d]
        real = (packed["weight"] > 0) & (packed["depth"] == 1)
        agree += int((q.argmax(-1) == p.argmax(-1))[real].sum())
    drafter.train(was_training)
    alpha_at = [s / max(c, 1) for s, c in zip(sums, counts)]
    return {
        "alpha": alpha_at[0],
        "greedy_agreement": agree / max(counts[0], 1),
        "tokens": counts[0],
        "alpha_at": [round(a, 4) for a in alpha_at],
        "accepted_length": accepted_length(alpha_at),
        # per round (chain), not from per-depth means: greedy, the drafts kept before the first
        # miss of a round started at each held-out anchor (mean over anchors)
        "round_accepted": rounds / max(n_rounds, 1),
    }
