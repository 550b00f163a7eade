"""Token-level divergences between the target p and the drafter q, as pure functions.

Conventions (GKD; the root DESIGN.md, "GKD naming"): p = target (teacher), q = drafter
(student, the one trained); `beta` picks the generalised JSD (0 = forward KL(p||q), 1 = reverse
KL(q||p)); positions whose mask is False (labels -100) contribute nothing. Every divergence is
computed in fp32 (float64 stays float64, for tests) from log-probabilities, whatever dtype the
logits arrive in.

The loss is a *sum* over unmasked tokens divided by `num_tokens`, the number of tokens in the
whole gradient-accumulation window (across ranks), which the trainer passes in: normalising
per micro-batch would weight a token of a short micro-batch more than one of a long one, so 2
micro-batches would not equal 1 batch of the same tokens.

Chunking: `distill_loss` walks the sequence in chunks of `chunk_size` positions and, per chunk,
computes the fp32 log-softmaxes, the loss and its gradient w.r.t. the drafter logits at once
(a custom autograd function, like a fused cross-entropy). Only one chunk's fp32 [b, c, V]
intermediates live at a time, so a 128k vocabulary never materialises fp32 logits for the
whole batch; the gradient is stored in the logits' own dtype. Values and gradients equal the
unchunked computation (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdistill.decode.acceptance import expected_alpha

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")
_REST_FLOOR = -80.0  # log-prob floor of the top-k "rest" bucket (e^-80 ~ 2e-35: zero mass)


def _kl_to_mixture_over_w(la: torch.Tensor, lb: torch.Tensor, w: float) -> torch.Tensor:
    """KL(a || m) / w with m = (1 - w) a + w b, summed over the last dim, for w in [0, 1].

    log(m / a) = log((1 - w) + w b/a) = logaddexp(log1p(-w), log w + lb - la): exact in log
    space for every w. It is O(w) for small w, and dividing it by w per term (not after
    summing) keeps the absolute error O(eps) instead of O(eps / w) near w = 0. At w = 1 it is
    KL(a||b) (log1p(-1) = -inf); its limit at w = 0 is sum(a - b) = 0.
    """
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"mixture weight {w} outside [0, 1]")
    if w == 0.0:
        return torch.zeros(la.shape[:-1], dtype=la.dtype, device=la.device)
    log_ratio = torch.logaddexp(
        torch.tensor(math.log1p(-w) if w < 1.0 else float("-inf"), dtype=la.dtype),
        math.log(w) + lb - la,
    )
    return -(la.exp() * log_ratio).sum(-1) / w


def token_fkl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Forward KL(p||q) per position from log-probs: mode-covering, the usual KD loss."""
    return (lp.exp() * (lp - lq)).sum(-1)


def token_rkl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Reverse KL(q||p) per position: mode-seeking, the drafter's own mass is what is weighed."""
    return (lq.exp() * (lq - lp)).sum(-1)


def token_tvd(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """0.5 * sum|p - q| per position; 1 - TVD is exactly the speculative acceptance rate."""
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)


def token_jsd(lp: torch.Tensor, lq: torch.Tensor, beta: float) -> torch.Tensor:
    """Normalised generalised JSD(beta), continuous on [0, 1] with JSD(0)=FKL, JSD(1)=RKL.

    GKD defines m = beta p + (1 - beta) q and JSD(beta) = beta KL(p||m) + (1 - beta) KL(q||m),
    which vanishes at both ends. We divide by beta (1 - beta):

        D(beta) = KL(p||m) / (1 - beta) + KL(q||m) / beta.

    Near beta = 0: m = q + beta (p - q), so KL(p||m) -> KL(p||q) while KL(q||m) = O(beta^2)
    (its first-order term is beta sum(p - q) = 0), so D -> KL(p||q). Symmetrically D -> KL(q||p)
    as beta -> 1. D(0.5) = 4 JSD, the usual symmetric JSD up to a constant. Both terms are
    computed by `_kl_to_mixture_over_w`, whose value at w = 0 is its limit, so beta = 0 and 1
    go through the same formula as any other beta.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} outside [0, 1]")
    # m = (1 - w) p + w q with w = 1 - beta, and m = (1 - w) q + w p with w = beta.
    return _kl_to_mixture_over_w(lp, lq, 1.0 - beta) + _kl_to_mixture_over_w(lq, lp, beta)


def token_divergence(
    name: str, lp: torch.Tensor, lq: torch.Tensor, beta: float = 0.5
) -> torch.Tensor:
    """Dispatch by name (fkl | rkl | tvd | jsd) on log-probs p (target) and q (drafter)."""
    if name == "fkl":
        return token_fkl(lp, lq)
    if name == "rkl":
        return token_rkl(lp, lq)
    if name == "tvd":
        return token_tvd(lp, lq)
    if name == "jsd":
        return token_jsd(lp, lq, beta)
    raise ValueError(f"unknown divergence {name!r}; use one of {DIVERGENCES}")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 kept as is (so tests can check the math to 1e-12 against float64)."""
    return x if x.dtype == torch.float64 else x.float()


# ---------------------------------------------------------------------------------------------
# Target representations: full logits, or the generate stage's stored top-k log-probs.


def full_logprobs(
    student: torch.Tensor, target: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (log p, log q) over the full vocab at the distillation temperature."""
    lq = F.log_softmax(at_least_fp32(student) / temperature, dim=-1)
    lp = F.log_softmax(at_least_fp32(target) / temperature, dim=-1)
    return lp, lq


def topk_logprobs(
    student: torch.Tensor, topk_ids: torch.Tensor, topk_lp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q) on a (K+1)-way support: the target's top-k tokens plus one "rest" bucket.

    The generate stage stores log p (T = 1, full-vocab softmax) for the target's top-k tokens
    only. Treating those K values as a distribution would renormalise them and overstate p on
    the top-k; dropping the rest would ignore where q puts its remaining mass. Instead both p
    and q are coarse-grained onto the same K+1 outcomes: p_rest = 1 - sum_k p_k, and
    q_rest = sum of q over every token not in the top-k (a logsumexp over the full drafter
    vocab with the top-k masked out, so no cancellation). Any f-divergence (KL, TVD, JSD) of the
    coarse-grained pair is a lower bound of the full one (data processing) and equals it when
    K = V or the rest buckets carry no mass. Rest log-probs are floored at -80 (zero mass) so
    K = V stays finite. Temperature must be 1: the stored log-probs are at T = 1.

    An entry with log p = -inf (no mass; nothing stores one today) is floored on both sides, so
    it adds no term (q's mass at its token is then counted nowhere) and no NaN. A draft
    vocabulary (the student scores a token subset) does not come here: the target's mass
    outside the subset is one q cannot earn, which a rest bucket would hide; it takes
    intersection.py's loss instead (distill/train/shared_vocab.py).
    """
    lq_full = F.log_softmax(at_least_fp32(student), dim=-1)
    ids = topk_ids.long()
    lq_rest = lq_full.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    return coarse_topk(lq_full.gather(-1, ids), lq_rest, topk_lp)


def coarse_topk(
    lq_k: torch.Tensor, lq_rest: torch.Tensor, topk_lp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K+1)-way (log p, log q) of `topk_logprobs` from the drafter's log q at the top-k ids
    [..., K] and over the rest [..., 1]: the one place the floors and the rest bucket are set,
    shared with the fused head loss (distill/head_loss.py), which gets those from chunks."""
    lp_k = topk_lp.to(lq_k.dtype)
    valid = lp_k > float("-inf")
    lq_k = torch.where(valid, lq_k, _REST_FLOOR)
    lp_k = torch.where(valid, lp_k, _REST_FLOOR)
    mass_k = lp_k.logsumexp(-1, keepdim=True).clamp(max=0.0)
    lp_rest = torch.log((-torch.expm1(mass_k)).clamp(min=0.0)).clamp(min=_REST_FLOOR)
    lq_rest = lq_rest.clamp(min=_REST_FLOOR)
    return torch.cat([lp_k, lp_rest], -1), torch.cat([lq_k, lq_rest], -1)


# ---------------------------------------------------------------------------------------------
# Masked, window-normalised, chunked loss.

TokenFn = Callable[..., torch.Tensor]  # (student_chunk, *target_chunks) -> [b, c]


def _token_fn(
    divergence: str, beta: float, temperature: float, topk: bool
) -> Callable[..., torch.Tensor]:
    if topk:
        if temperature != 1.0:
            raise ValueError("stored top-k log-probs are at temperature 1; use temperature=1")

        def fn(s: torch.Tensor, ids: torch.Tensor, lpk: torch.Tensor) -> torch.Tensor:
            lp, lq = topk_logprobs(s, ids, lpk)
            return token_divergence(divergence, lp, lq, beta)

    else:

        def fn(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            lp, lq = full_logprobs(s, t, temperature)
            return token_divergence(divergence, lp, lq, beta)

    return fn


class _ChunkedLoss(torch.autograd.Function):
    """Sum over masked positions of fn(student, *targets), computing the gradient per chunk."""

    @staticmethod
    def forward(ctx, student, mask, fn, chunk_size, *targets):  # type: ignore[override]
        grad = torch.zeros_like(student)
        # float64 logits keep a float64 sum (tests compare with unchunked float64 references)
        dtype = torch.float64 if student.dtype == torch.float64 else torch.float32
        total = torch.zeros((), dtype=dtype, device=student.device)
        weight = mask.to(torch.float32)
        for start in range(0, student.shape[1], chunk_size):
            sl = slice(start, start + chunk_size)
            w = weight[:, sl]
            if not bool(w.any()):
                continue
            with torch.enable_grad():
                s = student[:, sl].detach().requires_grad_(True)
                value = (fn(s, *(t[:, sl] for t in targets)) * w).sum()
                (g,) = torch.autograd.grad(value, s)
            total += value.detach()
            grad[:, sl] = g.to(grad.dtype)
        ctx.save_for_backward(grad)
        ctx.n_targets = len(targets)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype), None, None, None) + (None,) * ctx.n_targets


def distill_loss(
    student_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    target_logits: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_lp: torch.Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    num_tokens: float | torch.Tensor | None = None,
    chunk_size: int | None = 256,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_{masked positions} D(p_t || q_t) / num_tokens, gradient w.r.t. the drafter logits only.

    student_logits [b, n, V] (drafter q), mask [b, n] (True where the position's next token is
    a completion token). The target is either `target_logits` [b, n, V] (no grad) or the stored
    `topk_ids`/`topk_lp` [b, n, K]. `num_tokens` is the token count of the whole accumulation
    window across ranks (default: this mask's count). `chunk_size=None` computes unchunked with
    plain autograd (the reference the chunked path is tested against). `weights` [b, n] scales
    each masked position's term (parallel drafting weighs draft depths, distill.parallel).
    """
    if (target_logits is None) == (topk_ids is None):
        raise ValueError("pass exactly one of target_logits or topk_ids/topk_lp")
    topk = topk_ids is not None
    targets = (topk_ids, topk_lp) if topk else (target_logits,)
    targets = tuple(t.detach() for t in targets)  # type: ignore[union-attr]
    fn = _token_fn(divergence, beta, temperature, topk)
    mask = mask.bool()
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    weight = mask if weights is None else mask * weights.detach().float()
    return masked_sum(student_logits, weight, fn, targets, chunk_size) / num_tokens


def masked_sum(
    student: torch.Tensor,
    weight: torch.Tensor,
    fn: TokenFn,
    targets: tuple[torch.Tensor, ...],
    chunk_size: int | None,
) -> torch.Tensor:
    """sum over positions of fn(student, *targets) * weight, student [b, n, V], weight and
    targets [b, n, ...] (no grad): in chunks of `chunk_size` positions with the gradient computed
    per chunk (`_ChunkedLoss`), so only one chunk's fp32 intermediates live; plain autograd (any
    shape) when `chunk_size` is None or no gradient is needed. Shared by `distill_loss` and
    intersection.tli_loss."""
    if chunk_size is None or not student.requires_grad:
        per_token = fn(student, *targets)
        return (per_token * weight.to(per_token.dtype)).sum()
    return _ChunkedLoss.apply(student, weight, fn, int(chunk_size), *targets)


def per_token_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """sum_x min(p, q) per position (target p, drafter q): the chance a drafted token is kept."""
    lp, lq = full_logprobs(q_logits, p_logits, temperature)
    return expected_alpha(lp.exp(), lq.exp())


def expected_acceptance(
    p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """alpha = mean over masked positions of sum_x min(p, q) = 1 - mean TVD(p, q)."""
    m = mask.bool()
    acc = per_token_acceptance(p_logits, q_logits, temperature)
    return acc[m].mean() if bool(m.any()) else acc.new_tensor(float("nan"))
