"""The distill loss and acceptance of a drafter q served through a vocabulary intersection (TLI).

Target p (over the target's ids), drafter q (over its own rows). Under TLI serving (vLLM's
`use_heterogeneous_vocab`, Timor et al. 2025) the drafter's logits z are restricted to the rows
I_d that map to a target id (`VocabMapping.draft_to_target` >= 0), softmaxed over those rows
only, and moved into target ids by summing rows that map to the same id (many-to-one):

    q(x) = sum_{r in I_d, d2t[r] = x} softmax_{I_d}(z)_r      for x in I = d2t(I_d), else 0.

I is the image of d2t, not {x : t2d[x] >= 0}: a target id that spells the same bytes as another
(a duplicate) reads fine, but q can only propose the canonical one. Acceptance of a drafted
token is sum_{x in I} min(p(x), q(x)) (sampling) or [argmax q = argmax p] (greedy).

A drafter of the target's own tokenizer trained over its draft vocabulary (`draft_vocab_train`:
its head scores K kept ids only, as our decoder drafts) is the same problem with d2t[j] = the
j-th kept id over its K head columns (train/shared_vocab.py `train_head_ids`), so it takes this loss.

Which treatment of the target's mass m_out = p(outside I) maximises acceptance (derivation;
tests/distill/test_intersection.py checks each claim against a grid search over q):

(a) renormalise p over I (p_I = p / m, m = p(I)) and distil to p_I;
(b) keep p's raw masses on I and put m_out on an outcome q cannot produce (q = 0 there);
(c) drop positions whose target token is outside I.

- One position, q free: max_q sum_I min(p, q) = m, reached by every q >= p on I (q sums to
  1 >= m), so the acceptance-optimal q is a set, not renormalised p alone; p_I is one member.
  Every divergence under (a) or (b) is minimised inside that set (FKL/RKL/JSD at q = p_I: their
  per-outcome terms are p phi(q/p) with phi strictly convex, so q/p is constant on I; TVD under
  (b) on the whole set), so per position the treatments tie.
- Positions share q's parameters (a drafter cannot fit every context): then the treatments
  weigh positions differently, and that decides acceptance. Under (b) TVD is *exactly* the
  rejection probability: 0.5 (sum_I |p - q| + m_out) = 1 - sum_I min(p, q), so the summed (b)-TVD
  over positions is N - (total acceptance) and its minimiser maximises acceptance in any model
  family. (b)-FKL = m KL(p_I || q) + const: each position weighted by the mass the drafter can
  earn there, m. (a) weighs a position with 1% of its mass reachable like one with 100%, and
  pulls a shared q towards it: in the grid test (a)'s minimisers lose acceptance that (b)'s keep.
  (b)-RKL = KL(q || p_I) - log m has (a)'s gradient (RKL cannot see m). (c) on sampled labels is
  a noisy (b) weighting (the label is outside I with probability m_out).
- Greedy serving: acceptance is [argmax q = argmax p], and a position whose target argmax is
  outside I is never accepted whatever q is: its gradient only costs capacity. So for greedy
  serving those positions are dropped (`mask_unreachable`: (c) keyed on the target's argmax,
  which is the row's label for greedy Seq-KD data); on the rest (b) applies.

Chosen: (b) for every divergence, plus the greedy mask where the drafter is served greedily.

Values: losses are the divergence over the outcomes in I plus, for TVD, the outside outcome's
constant m_out / 2 (so TVD reads as 1 - acceptance); FKL's outside term is infinite and JSD's a
q-independent constant, both dropped (gradients are unchanged). p over I is not renormalised.

Stored top-k targets (log p at K target ids, T = 1): outcomes are the K ids (those outside I
contribute nothing on I and their mass joins m_out), plus one "rest in I" outcome: p's tail
1 - sum_k p_k (assumed reachable, the convention `losses.topk_logprobs` makes for a shared
vocabulary; exact when the tail is empty) against q's mass on I outside the top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdistill.distill.losses import DIVERGENCES, at_least_fp32, masked_sum, token_divergence

FLOOR = -80.0  # log-prob floor (e^-80 ~ 2e-35: no mass), as in losses.py
_TINY = math.exp(FLOOR)


@dataclass(frozen=True)
class Intersection:
    """The intersection I as index tensors (pure data; build with `from_draft_to_target`).

    rows [R]: drafter rows in I_d (d2t >= 0); row_slot [Vd]: slot of each drafter row in
    0..S-1, -1 outside; slot_ids [S]: the target id of each slot (distinct, ascending);
    target_slot [Vt]: slot of each target id, -1 when q can never propose it; served_row [Vt]:
    the first drafter row proposing each target id (-1 none).
    """

    rows: torch.Tensor
    row_slot: torch.Tensor
    slot_ids: torch.Tensor
    target_slot: torch.Tensor
    served_row: torch.Tensor
    one_to_one: bool
    slot_rows: torch.Tensor  # [S] one-to-one only: the position in `rows` of each slot's row

    @classmethod
    def from_draft_to_target(cls, d2t: torch.Tensor, target_vocab: int) -> Intersection:
        """From `VocabMapping.draft_to_target` (resized to the drafter's logit rows) and the
        target's logit rows. Raises ValueError when no drafter row maps (q has no support)."""
        d2t = d2t.long()
        if d2t.numel() and int(d2t.max()) >= target_vocab:
            raise ValueError(f"draft_to_target points past the target's {target_vocab} rows")
        rows = torch.nonzero(d2t >= 0).flatten()
        if rows.numel() == 0:
            raise ValueError("the drafter shares no token with the target: I is empty")
        slot_ids, inverse = torch.unique(d2t[rows], sorted=True, return_inverse=True)
        row_slot = torch.full_like(d2t, -1)
        row_slot[rows] = inverse
        target_slot = torch.full((target_vocab,), -1, dtype=torch.long)
        target_slot[slot_ids] = torch.arange(slot_ids.numel())
        served_row = torch.full((target_vocab,), -1, dtype=torch.long)
        served_row[d2t[rows].flip(0)] = rows.flip(0)  # the first row wins (last write)
        one_to_one = slot_ids.numel() == rows.numel()
        slot_rows = torch.argsort(inverse) if one_to_one else inverse.new_zeros(0)
        return cls(rows, row_slot, slot_ids, target_slot, served_row, one_to_one, slot_rows)

    @property
    def size(self) -> int:
        """|I| in target ids (slots)."""
        return int(self.slot_ids.numel())

    def to(self, device) -> Intersection:
        t = (self.rows, self.row_slot, self.slot_ids, self.target_slot, self.served_row)
        return Intersection(*(x.to(device) for x in t), self.one_to_one, self.slot_rows.to(device))


# ------------------------------------------------------------------------------- served q


def served_logq(z: torch.Tensor, inter: Intersection, temperature: float = 1.0) -> torch.Tensor:
    """log q over I's slots [..., S] from drafter logits z [..., Vd]: softmax over I_d's rows at
    `temperature`, rows of one target id summed; floored at FLOOR (no -inf, finite gradients)."""
    lq_rows = F.log_softmax(at_least_fp32(z).index_select(-1, inter.rows) / temperature, -1)
    if inter.one_to_one:  # each slot is one row: a permutation, no sum
        return lq_rows.index_select(-1, inter.slot_rows).clamp(min=FLOOR)
    mass = lq_rows.new_zeros((*lq_rows.shape[:-1], inter.size))
    mass = mass.index_add(-1, inter.row_slot[inter.rows], lq_rows.exp())
    return mass.clamp(min=_TINY).log()


def served_target_logits(
    z: torch.Tensor, inter: Intersection, target_vocab: int, temperature: float = 1.0
) -> torch.Tensor:
    """log q in the target's ids [..., target_vocab] (-inf outside I): the distribution the
    verifier sees, for `decode.acceptance` helpers that take target-space logits."""
    lq = served_logq(z, inter, temperature)
    out = lq.new_full((*lq.shape[:-1], target_vocab), float("-inf"))
    out[..., inter.slot_ids] = lq
    return out


def served_argmax(z: torch.Tensor, inter: Intersection) -> torch.Tensor:
    """The served greedy draft in target ids: argmax of q after the many-to-one sum."""
    return inter.slot_ids[served_logq(z, inter).argmax(-1)]


# ------------------------------------------------------------------------------- (lp, lq) over I


@dataclass(frozen=True)
class Outcomes:
    """p and q over the outcomes the loss compares: lp, lq [..., M] (p unnormalised: it sums to
    the mass in I), lp_out [...] = log p(outside I), where q is 0; reachable [...] = the target's
    argmax is in I (greedy acceptance is possible)."""

    lp: torch.Tensor
    lq: torch.Tensor
    lp_out: torch.Tensor
    reachable: torch.Tensor


def full_outcomes(
    z: torch.Tensor, target_logits: torch.Tensor, inter: Intersection, temperature: float = 1.0
) -> Outcomes:
    """Live target logits [..., Vt] (no grad): outcomes are I's slots."""
    lp = F.log_softmax(at_least_fp32(target_logits).detach() / temperature, -1)
    lp_in = lp.index_select(-1, inter.slot_ids)
    outside = lp.index_fill(-1, inter.slot_ids, float("-inf")).logsumexp(-1)
    reachable = inter.target_slot[lp.argmax(-1)] >= 0
    lq = served_logq(z, inter, temperature)
    return Outcomes(lp_in.clamp(min=FLOOR), lq, outside.clamp(min=FLOOR), reachable)


def topk_outcomes(
    z: torch.Tensor, topk_rows: torch.Tensor, topk_lp: torch.Tensor, inter: Intersection
) -> Outcomes:
    """Stored top-k targets: `topk_rows` [..., K] are the target's top-k ids mapped to drafter
    rows (`served_row`; -1 where q can never propose the token), `topk_lp` their log p at T = 1
    (rank 0 = the target's argmax). Outcomes: the K entries (an entry outside I is floored on
    both sides: its mass joins lp_out) and the rest in I (p's tail vs q's mass on I off the
    top-k)."""
    rows = topk_rows.long()
    slot = torch.where(rows >= 0, inter.row_slot[rows.clamp(min=0)], -1)
    lp_k = topk_lp.detach().to(torch.float64 if z.dtype == torch.float64 else torch.float32)
    valid = (slot >= 0) & (lp_k > float("-inf"))
    lq_all = served_logq(z, inter)
    lq_k = torch.where(valid, lq_all.gather(-1, slot.clamp(min=0)), FLOOR)
    # q's mass on I off the stored top-k: the slots of valid entries set to -inf (no 1 - sum).
    hide = torch.where(valid, slot, lq_all.shape[-1])  # invalid entries scatter into a spare
    spare = torch.cat([lq_all, lq_all.new_full((*lq_all.shape[:-1], 1), FLOOR)], -1)
    # (a finite -1e4, not -inf: a row whose every slot is hidden keeps a finite gradient)
    lq_rest = spare.scatter(-1, hide, -1e4)[..., :-1].logsumexp(-1, keepdim=True)
    lp_in_k = torch.where(valid, lp_k, FLOOR)
    lp_out_k = torch.where(valid | (lp_k == float("-inf")), float("-inf"), lp_k).logsumexp(-1)
    top_mass = lp_k.logsumexp(-1).clamp(max=0.0)
    lp_rest = torch.log((-torch.expm1(top_mass)).clamp(min=0.0))[..., None]
    lp = torch.cat([lp_in_k, lp_rest], -1).clamp(min=FLOOR)
    lq = torch.cat([lq_k, lq_rest], -1).clamp(min=FLOOR)
    return Outcomes(lp, lq, lp_out_k.clamp(min=FLOOR), slot[..., 0] >= 0)


def tli_divergence(name: str, o: Outcomes, beta: float = 0.5) -> torch.Tensor:
    """Per-position loss under treatment (b) (module docstring): the divergence's terms over I,
    plus m_out / 2 for TVD (= 1 - sum_I min(p, q) exactly); FKL/JSD's constant outside terms
    are dropped. Target p, drafter q; `beta` as in losses.token_jsd."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; use one of {DIVERGENCES}")
    value = token_divergence(name, o.lp, o.lq, beta)
    if name == "tvd":
        value = value + 0.5 * o.lp_out.exp() * (o.lp_out > FLOOR)
    return value


def tli_loss(
    student_logits: torch.Tensor,
    mask: torch.Tensor,
    inter: Intersection,
    *,
    target_logits: torch.Tensor | None = None,
    topk_rows: torch.Tensor | None = None,
    topk_lp: torch.Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    num_tokens: float | torch.Tensor | None = None,
    mask_unreachable: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """sum over masked positions of the (b) loss / num_tokens; gradient w.r.t. the drafter only.

    student_logits [..., Vd] (drafter q, its own rows), mask [...]; the target is
    `target_logits` [..., Vt] or the stored `topk_rows`/`topk_lp` [..., K] (temperature 1).
    `mask_unreachable` (greedy serving): positions whose target argmax is outside I add 0.
    `num_tokens`: the accumulation window's tokens (default this mask's count), unchanged by
    `mask_unreachable`, so the loss stays a mean over the window's positions. `chunk_size`:
    student_logits [b, n, Vd] walked in chunks of that many positions, the gradient computed
    per chunk (`losses.masked_sum`, as `distill_loss` does: a big draft vocabulary's fp32
    intermediates never live for every position at once); None: plain autograd, any shape.
    """
    if (target_logits is None) == (topk_rows is None):
        raise ValueError("pass exactly one of target_logits or topk_rows/topk_lp")
    if topk_rows is not None:
        if temperature != 1.0:
            raise ValueError("stored top-k log-probs are at temperature 1; use temperature=1")
        targets: tuple[torch.Tensor, ...] = (topk_rows, topk_lp)  # type: ignore[assignment]
    else:
        targets = (target_logits,)

    def per_position(z: torch.Tensor, *target: torch.Tensor) -> torch.Tensor:
        if len(target) == 2:
            o = topk_outcomes(z, target[0], target[1], inter)
        else:
            o = full_outcomes(z, target[0], inter, temperature)
        value = tli_divergence(divergence, o, beta)
        return value * o.reachable.to(value.dtype) if mask_unreachable else value

    mask = mask.bool()
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    targets = tuple(t.detach() for t in targets)
    return masked_sum(student_logits, mask, per_position, targets, chunk_size) / num_tokens


# ------------------------------------------------------------------------------- acceptance


def tli_acceptance_full(
    z: torch.Tensor, p_logits: torch.Tensor, inter: Intersection, greedy: bool
) -> torch.Tensor:
    """Per-position acceptance under TLI at T = 1 (sampling) or greedy, against live target
    logits [..., Vt]: sum_x min(p(x), q(x)) over target ids, or [served argmax = argmax p]."""
    if greedy:
        return (served_argmax(z, inter) == p_logits.argmax(-1)).to(torch.float32)
    lp = F.log_softmax(at_least_fp32(p_logits), -1).index_select(-1, inter.slot_ids)
    return torch.minimum(lp, served_logq(z, inter)).exp().sum(-1)


def tli_acceptance_topk(
    z: torch.Tensor, topk_rows: torch.Tensor, topk_lp: torch.Tensor, inter: Intersection,
    greedy: bool,
) -> torch.Tensor:  # fmt: skip
    """The same from stored top-k (rows mapped as in `topk_outcomes`): greedy is exact (rank 0
    is argmax p); sampling sums min(p, q) over the top-k in I only (a lower bound)."""
    rows = topk_rows.long()
    slot = torch.where(rows >= 0, inter.row_slot[rows.clamp(min=0)], -1)
    lq = served_logq(z, inter)
    if greedy:
        return ((slot[..., 0] >= 0) & (lq.argmax(-1) == slot[..., 0])).to(torch.float32)
    lq_k = lq.gather(-1, slot.clamp(min=0))
    both = torch.minimum(topk_lp.to(lq_k.dtype), lq_k).exp()
    return torch.where(slot >= 0, both, 0.0).sum(-1)
