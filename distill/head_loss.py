"""The distill loss from the drafter's hidden states and LM head, never the full logits.

Target p, drafter q (the root DESIGN.md, "GKD naming"; the divergences are `losses.py`'s). A
drafter of a 262k-token target spends most of a distill step on its head: [N, V] logits, their
fp32 log-softmax, the (K+1)-way gather/scatter of stored top-k targets and the backward of each,
several [N, V] fp32 tensors alive at once (8 rows x 2048 positions x 262k rows is 17 GB each).
`fused_distill_loss` takes the final hidden states h [N, H] at the loss positions and the head
W [V, H] (+ bias), walks the positions in chunks of P, and per chunk computes the logits, the
loss and its gradient w.r.t. those logits at once, turns that into the gradients w.r.t. h (and
W, b when trainable: `ctx` holds them, one [N, H] and one [V, H] like `.grad` itself) and drops
the chunk. Values and gradients equal the full computation (tests/distill/test_head_loss.py,
float64 to 1e-10); FLOPs equal it too: one head matmul forward, one per gradient.

What each divergence needs over every vocabulary row (why chunks of positions, not of rows):
- Stored top-k targets, any divergence (FKL, RKL, TVD, JSD(beta)): the loss lives on the K+1
  outcomes of `losses.topk_logprobs`, so q enters only through z at the K ids, the
  log-normaliser A = logsumexp_x z_x and the rest normaliser logsumexp over x outside the
  top-k (summed without the top-k terms, so no 1 - sum cancellation). The gradient w.r.t. z_x
  is q_x (dL/dA + dL/drest / q_rest) off the top-k, and dL/dA q_x + dL/dz_k on it. Here one
  [P, V] buffer serves as logits, exp and gradient (`_topk_chunk`): ~5 passes over it instead
  of autograd's ~15 tensors.
- Full (live-target) distributions: FKL needs A, B = logsumexp t and E_p[z]; RKL needs A, B and
  E_q[z - t]; each is one online (running-max) pass over rows. TVD (|p_x - q_x|) and JSD(beta)
  (log of the mixture per row) need p_x and q_x normalised, so A and B first, then a second pass,
  and the gradient q_x (g_x - E_q[g]) a third. Here each chunk runs `losses.full_logprobs` and
  `token_divergence` under autograd (exact by construction, a few [P, V] temporaries).
- Chunking the rows instead would keep [N, R] tiles, but every divergence needs A (or B) before
  any row's gradient, so the head's matmul would run again in the backward (1 extra matmul of
  the 2-3); one chunk of positions holds all V rows, so its normalisers are local and nothing is
  recomputed. Memory is one chunk's [P, V] (`positions_per_chunk`: CHUNK_ELEMENTS / V).
- Why an autograd.Function that makes the gradients in forward rather than
  `torch.utils.checkpoint` per chunk: checkpointing runs each chunk's matmul again in the
  backward and holds autograd's intermediates of that chunk (several [P, V] tensors) while it
  does; here a top-k chunk holds one buffer and nothing is recomputed (reasoned, not measured).

Why not a library: Liger-Kernel (0.8.5, PyPI) needs Triton for its fused linear cross
entropy and fused linear JSD kernels (no CPU); its pure-torch `chunked_loss.LigerFusedLinearJSDLoss`
imports and runs on CPU but takes only a full teacher (hidden + head), computes GKD's
un-normalised JSD mixed with a hard CE term and has no stored-top-k target and no TVD: it fits
none of our stored-top-k runs, so the chunked torch form here is the one path (CPU and GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdistill.distill.losses import (
    at_least_fp32,
    coarse_topk,
    full_logprobs,
    token_divergence,
)

# Elements of one chunk's [P, V] fp32 logits (64 MiB): bigger chunks matmul a little better
# (distill/RESULTS.md), and 2^24 bounds a chunk at 64 MiB on a GPU too.
CHUNK_ELEMENTS = 1 << 24
# `distill.chunked_loss: auto` turns the fused loss on for heads this large (distill/RESULTS.md).
AUTO_MIN_VOCAB = 32768


@dataclass(frozen=True)
class HeadInput:
    """A model's final hidden states at the loss positions and its LM head, cut to `vocab` rows.

    hidden [..., H]; weight [V, H] (a view: gradients reach the full parameter); bias [V] or None.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def logits(self, rows: slice) -> torch.Tensor:
        """fp32 (or float64) logits of positions `rows` of the flattened hidden states."""
        h = self.hidden.reshape(-1, self.hidden.shape[-1])[rows]
        return at_least_fp32(F.linear(h, self.weight, self.bias))


def positions_per_chunk(vocab: int, n: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Positions per chunk so that one chunk's [P, vocab] logits hold about `elements`."""
    return max(1, min(n, elements // max(vocab, 1)))


def _topk_chunk(
    z: torch.Tensor, ids: torch.Tensor, lpk: torch.Tensor, w: torch.Tensor, div: str, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_positions w * D, dvalue/dz) for stored top-k targets; `z` [P, V] is consumed (it is
    overwritten by exp, then by the gradient, so one buffer is alive)."""
    zk = z.gather(-1, ids)
    m = z.amax(-1, keepdim=True)
    e = z.sub_(m).exp_()
    s = e.sum(-1)
    e.scatter_(-1, ids, 0.0)
    r = e.sum(-1)  # the rest's mass, without the top-k terms (no cancellation)
    m = m.squeeze(-1)
    with torch.enable_grad():
        zk_ = zk.detach().requires_grad_(True)
        a = (m + s.log()).requires_grad_(True)
        rest = (m + r.log()).requires_grad_(True)
        lp, lq = coarse_topk(zk_ - a[:, None], (rest - a)[:, None], lpk)
        value = (token_divergence(div, lp, lq, beta) * w.to(lq.dtype)).sum()
        g_k, g_a, g_rest = torch.autograd.grad(value, (zk_, a, rest))
    # q_x = e_x / s; d rest / d z_x = e_x / r off the top-k (rest = -inf has a zero gradient)
    coef = g_a / s + torch.where(r > 0, g_rest / r, torch.zeros_like(r))
    g = e.mul_(coef[:, None])
    g.scatter_(-1, ids, g_a[:, None] * (zk - a.detach()[:, None]).exp())
    g.scatter_add_(-1, ids, g_k)
    return value.detach(), g


def _full_chunk(
    z: torch.Tensor, t: torch.Tensor, w: torch.Tensor, div: str, beta: float, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_positions w * D, dvalue/dz) against full target logits `t` [P, V], by autograd."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        lp, lq = full_logprobs(z, t, temperature)
        value = (token_divergence(div, lp, lq, beta) * w.to(lq.dtype)).sum()
        (g,) = torch.autograd.grad(value, z)
    return value.detach(), g


@dataclass(frozen=True)
class _Spec:
    """Everything but the student: the target and the loss settings (no gradients)."""

    divergence: str
    beta: float
    temperature: float
    chunk: int
    topk_ids: torch.Tensor | None = None  # [N, K]
    topk_lp: torch.Tensor | None = None  # [N, K]
    target: torch.Tensor | HeadInput | None = None  # [N, V] logits, or the target's head

    def chunk_value_and_grad(
        self, student: HeadInput, rows: slice, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = student.logits(rows)
        if self.topk_ids is not None:
            lpk = self.topk_lp[rows]  # type: ignore[index]
            return _topk_chunk(z, self.topk_ids[rows], lpk, w, self.divergence, self.beta)
        if isinstance(self.target, HeadInput):
            with torch.no_grad():
                t = self.target.logits(rows)
        else:
            t = at_least_fp32(self.target[rows])  # type: ignore[index]
        return _full_chunk(z, t, w, self.divergence, self.beta, self.temperature)


def _run(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    w: torch.Tensor,
    spec: _Spec,
    grads: bool,
) -> tuple[torch.Tensor, ...]:
    """The summed weighted loss and, with `grads`, its gradients w.r.t. hidden, weight, bias."""
    student = HeadInput(hidden, weight, bias)
    n = hidden.shape[0]
    acc = at_least_fp32(hidden.new_zeros(()))
    g_h = torch.zeros_like(hidden) if grads and hidden.requires_grad else None
    g_w = at_least_fp32(torch.zeros_like(weight)) if grads and weight.requires_grad else None
    need_b = grads and bias is not None and bias.requires_grad
    g_b = at_least_fp32(torch.zeros_like(bias)) if need_b else None  # type: ignore[arg-type]
    for start in range(0, n, spec.chunk):
        rows = slice(start, start + spec.chunk)
        w_c = w[rows]
        if not bool(w_c.any()):
            continue
        value, g = spec.chunk_value_and_grad(student, rows, w_c)
        acc = acc + value.to(acc.dtype)
        if g_h is not None:
            g_h[rows] = (g.to(weight.dtype) @ weight).to(g_h.dtype)
        if g_w is not None:
            g_w.addmm_(g.t().to(g_w.dtype), hidden[rows].to(g_w.dtype))
        if g_b is not None:
            g_b += g.sum(0).to(g_b.dtype)
        del g
    return acc, g_h, g_w, g_b


class _FusedHeadLoss(torch.autograd.Function):
    """sum_positions w * D(p || q) with q = softmax(hidden W^T + b); gradients made in forward
    chunk by chunk (no logits kept for autograd), scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, w, spec):  # type: ignore[override]
        total, g_h, g_w, g_b = _run(hidden, weight, bias, w, spec, grads=True)
        ctx.grads = (g_h, g_w, g_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        out = [
            None if g is None else (g * grad_out.to(g.dtype)).to(dtype)
            for g, dtype in zip(grads, ctx.dtypes, strict=True)
        ]
        return out[0], out[1], out[2], None, None


def fused_distill_loss(
    student: HeadInput,
    mask: torch.Tensor,
    *,
    target_logits: torch.Tensor | HeadInput | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_lp: torch.Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    num_tokens: float | torch.Tensor | None = None,
    chunk_size: int | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`losses.distill_loss` with the student given as hidden states + head (`HeadInput`).

    The same keywords and value: sum over masked positions of D(p_t || q_t) / num_tokens
    (`num_tokens`: the accumulation window's tokens; default this mask's count). Leading dims of
    `student.hidden`, `mask`, the targets and `weights` are flattened to positions. The target
    is `target_logits` ([..., V] logits or the target's own `HeadInput`, no grad) or the stored
    `topk_ids`/`topk_lp` (temperature 1). `chunk_size`: positions per chunk (None: about
    CHUNK_ELEMENTS logits per chunk).
    """
    if (target_logits is None) == (topk_ids is None):
        raise ValueError("pass exactly one of target_logits or topk_ids/topk_lp")
    if topk_ids is not None and temperature != 1.0:
        raise ValueError("stored top-k log-probs are at temperature 1; use temperature=1")
    hidden = student.hidden.reshape(-1, student.hidden.shape[-1])
    n, vocab = hidden.shape[0], student.weight.shape[0]
    mask = mask.reshape(-1).bool()
    w = mask.float() if weights is None else mask * weights.detach().reshape(-1).float()
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    chunk = int(chunk_size) if chunk_size else positions_per_chunk(vocab, n)
    target = target_logits
    if isinstance(target, torch.Tensor):
        target = target.detach().reshape(n, -1)
    elif isinstance(target, HeadInput):
        target = HeadInput(target.hidden.detach().reshape(n, -1), target.weight.detach(),
                           None if target.bias is None else target.bias.detach())  # fmt: skip
    spec = _Spec(
        divergence=divergence,
        beta=float(beta),
        temperature=float(temperature),
        chunk=chunk,
        topk_ids=None if topk_ids is None else topk_ids.detach().reshape(n, -1).long(),
        topk_lp=None if topk_lp is None else topk_lp.detach().reshape(n, -1),
        target=target,
    )
    weight, bias = student.weight, student.bias
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    ):
        total = _FusedHeadLoss.apply(hidden, weight, bias, w, spec)
    else:
        total = _run(hidden, weight, bias, w, spec, grads=False)[0]
    return total / num_tokens
