"""The expected accepted length of a speculative round, its gradient, and per-depth weights.

p = target, q = drafter. A round drafts K tokens; draft d is kept with probability a_d given
that drafts 1..d-1 were kept, and the round stops at the first rejection, so

    E[accepted] = sum_{j=1..K} P_j,        P_j = prod_{i<=j} a_i   (P_0 = 1).

Per-depth acceptance a_d (what `soft_acceptance` computes from log-probs):
- sampling (speculative sampling, drafts drawn from q): a_d = sum_x min(p_d(x), q_d(x)) =
  1 - TVD(p_d, q_d), with p_d the target's distribution given the accepted prefix;
- a greedy target (temperature 0) with drafts drawn from q: a_d = q_d(t_d), t_d = argmax p_d.
  Only one prefix can be accepted, t_1..t_{d-1}, so p_d along the Seq-KD row is exactly the
  target's distribution at the accepted prefix and the formula is exact. It is the smooth
  version of greedy drafting's 0/1 agreement [argmax q_d = t_d], whose gradient is zero.
For sampling the formula is exact when p_d does not depend on the drafted prefix; on a
training row p_d is the target's at the row's prefix (the brute-force tests in
tests/distill/test_acceptance_loss.py enumerate both cases).

Gradient. With R_k = 1 + a_{k+1} R_{k+1} (R_K = 1), the expected length of the rest of the
round counting draft k itself, E = sum_{j<k} P_j + P_{k-1} a_k R_k, hence

    dE/da_k = P_{k-1} R_k = P(drafts 1..k-1 kept) * (1 + E[kept after draft k | draft k kept]).

So a draft counts by the chance its prefix is accepted times what accepting it unlocks, not
alike at every depth: this is the weight `length_weights` returns (detached). A divergence
weighted by it (Confidence-Adaptive-Token style, PARD-2) follows the gradient of E to first
order; with TVD it IS the gradient of -E in the sampling case, since d(1 - TVD_k) = da_k.
"""

from __future__ import annotations

import torch


def expected_accepted(a: torch.Tensor) -> torch.Tensor:
    """E[accepted drafts] = sum_j prod_{i<=j} a_i over the last dim (K depths), differentiable.

    a[..., d-1] is the chance draft d (target p, drafter q) is kept given drafts 1..d-1 were;
    depths a chain does not have are passed as 0 (nothing after them counts)."""
    return torch.cumprod(a, dim=-1).sum(-1)


def length_weights(a: torch.Tensor) -> torch.Tensor:
    """dE/da_k = P_{k-1} R_k per depth (same shape as a), in closed form and without division
    (a_k = 0 is fine): P_{k-1} = prod_{i<k} a_i, R_k = 1 + a_{k+1} R_{k+1}, R_K = 1."""
    a = a.detach()
    ones = torch.ones_like(a[..., :1])
    prefix = torch.cat([ones, torch.cumprod(a, -1)[..., :-1]], -1)  # P_{k-1}
    rest = [ones[..., 0]]
    for k in range(a.shape[-1] - 1, 0, -1):  # R_k from R_{k+1}; K <= 16, a Python loop is fine
        rest.append(1.0 + a[..., k] * rest[-1])
    return prefix * torch.stack(rest[::-1], -1)


def soft_acceptance(
    lq: torch.Tensor,
    *,
    lp: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position acceptance a (...,) of a draft from log q [..., V] (drafter), differentiable
    in lq: `target_ids` (...,) for a greedy target (a = q(t)), or log p [..., V] (target, at the
    serving temperature) for sampling (a = sum_x min(p, q)). On a stored top-k support lp/lq
    are the top-k columns only, which makes a a lower bound (the rest bucket is left out)."""
    if (lp is None) == (target_ids is None):
        raise ValueError("pass exactly one of lp (sampling) or target_ids (greedy target)")
    if target_ids is not None:
        return lq.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1).exp()
    return torch.minimum(lp, lq).exp().sum(-1)  # type: ignore[arg-type]


def chain_values(
    x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N) read at a chain layout index (B, A, K) -> (B, A, K), and the chain's usable
    prefix (B, A, K) bool: a depth counts only when every depth before it has a label too (a
    chain running past the row's end stops there). Unusable depths read 0."""
    b = x.shape[0]
    vals = x.reshape(b, -1).gather(1, index.clamp(min=0).reshape(b, -1)).reshape(index.shape)
    usable = torch.cumprod(valid.long(), -1).bool()
    return torch.where(usable, vals, torch.zeros((), dtype=x.dtype, device=x.device)), usable


def scatter_chain_weights(
    w: torch.Tensor, index: torch.Tensor, usable: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain weights (B, A, K) back onto the packed positions (B, N); also which positions got
    one (each packed position belongs to at most one chain)."""
    b = w.shape[0]
    idx = index.clamp(min=0).reshape(b, -1)
    use = usable.reshape(b, -1)
    out = torch.zeros(b, n, dtype=w.dtype, device=w.device)
    out.scatter_add_(1, idx, torch.where(use, w.reshape(b, -1), torch.zeros_like(out[:, :1])))
    hits = torch.zeros(b, n, dtype=torch.long, device=w.device).scatter_add_(1, idx, use.long())
    return out, hits > 0
