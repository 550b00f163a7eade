"""The decode figures a drafter will get, predicted from the distill stage's held-out set.

p = target, q = drafter. Greedy serving: along the target's own greedy continuation (eval
source `target`), a round's drafts are accepted exactly as long as q's argmax matches the next
token, and while they are, q's context *is* that continuation. So the teacher-forced agreement
string of each held-out row fixes every round of a fixed-gamma or heuristic-length decode, and
`decode.draft_length.replay` runs the decoder's own policy objects over it: tau, mean draft
length, plain target steps and, under a cost model (`DraftCosts`, measured on the pair when the
target is loaded), the speedup. On reference completions (eval source `reference`) the same
replay is an estimate: the decode would follow the target's text, not the reference.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from specdistill.decode.draft_length import (
    DraftCosts,
    Replay,
    costs_from_mapping,
    make_policy,
    replay,
)

if TYPE_CHECKING:
    from specdistill.distill.train.settings import TrainSettings

POLICIES = ("fixed", "heuristic", "confidence")


@torch.no_grad()
def heldout_outcomes(
    drafter, target, batches: list[dict[str, torch.Tensor]], *, vocab: int, device
) -> list[tuple[list[bool], list[float]]]:
    """Per held-out row, in order over its masked positions: does q's argmax match p's (the
    target's logits, or its stored top-1 when `target` is None), and q's probability of it."""
    was_training = drafter.training
    drafter.eval()
    rows: list[tuple[list[bool], list[float]]] = []
    for batch in batches:
        ids = batch["input_ids"].to(device)
        att = batch["attention_mask"].to(device)
        mask = batch["loss_mask"].to(device).bool()
        q = torch.softmax(
            drafter(input_ids=ids, attention_mask=att).logits[..., :vocab].float(), -1
        )
        q_conf, q_top = q.max(-1)
        if target is not None:
            p_top = target(input_ids=ids, attention_mask=att).logits[..., :vocab].argmax(-1)
        else:
            p_top = batch["topk_ids"].to(device)[..., 0]
        agree = q_top == p_top
        for r in range(ids.shape[0]):
            m = mask[r]
            if bool(m.any()):
                rows.append((agree[r][m].tolist(), q_conf[r][m].tolist()))
    drafter.train(was_training)
    return rows


def predict(
    rows: list[tuple[list[bool], list[float]]],
    *,
    gamma: int,
    max_draft: int,
    costs: DraftCosts,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, dict[str, float]]:
    """Replayed figures per policy over all rows (one policy object per policy, kept across
    rows like the decoder's: the floor's averages and the calibration carry over)."""
    figures: dict[str, dict[str, float]] = {}
    for name in policies:
        policy = make_policy(name, gamma, gamma if name == "fixed" else max_draft, costs)
        total = Replay()
        for accepted, conf in rows:
            total = total.add(replay(accepted, conf, policy))
        label = f"gamma={gamma}" if name == "fixed" else name
        figures[label] = total.figures()
    return figures


def heldout_prediction(tr: Any, drafter, s: TrainSettings) -> dict[str, Any] | None:
    """The prediction for the distill result (greedy serving, autoregressive drafting; None
    otherwise): the policies
    replayed with the costs from `eval.predict.costs` (`auto`: measured on the pair when the
    target is loaded, else the cost model's defaults, said so)."""
    pred = s.eval.predict
    if not pred.enabled or not tr.eval_sampling.greedy or not tr.eval_batches:
        return None
    if s.drafting != "autoregressive":
        return None  # a parallel round's drafts do not read their predecessors: no AR replay
    gamma, max_draft, raw = pred.gamma, pred.max_draft, pred.costs
    source = "configured"
    if raw not in (None, "auto"):
        costs = costs_from_mapping(raw)
    elif tr.target is not None:
        costs, source = measured_costs(tr, drafter, max_draft), "measured"
    else:
        costs, source = DraftCosts(), UNCALIBRATED
    rows = heldout_outcomes(drafter, tr.target, tr.eval_batches, vocab=tr.vocab, device=tr.device)
    out = {
        "eval_source": s.eval.source,
        "exact": s.eval.source == "target",
        "costs": dataclasses.asdict(costs) | {"source": source},
        "rows": len(rows),
        "gamma": gamma,
        "max_draft": max_draft,
        "figures": predict(rows, gamma=gamma, max_draft=max_draft, costs=costs),
    }
    if source == UNCALIBRATED:  # kept so a later stage's measured costs can price them
        out["outcomes"] = pack_outcomes(rows)
    return out


UNCALIBRATED = "default, uncalibrated (no target loaded: set eval.predict.costs)"


def pack_outcomes(rows: list[tuple[list[bool], list[float]]]) -> list[list[Any]]:
    """Rows as JSON: the agreement string ("1" = q's argmax was p's) and q's confidences."""
    return [
        ["".join("1" if a else "0" for a in agree), [round(c, 4) for c in conf]]
        for agree, conf in rows
    ]


def unpack_outcomes(packed: list[list[Any]]) -> list[tuple[list[bool], list[float]]]:
    """The inverse of `pack_outcomes` (confidences rounded to 4 digits)."""
    return [([ch == "1" for ch in agree], [float(c) for c in conf]) for agree, conf in packed]


def costs_from_validate(c: float, verify_cost: float, gamma: int) -> DraftCosts:
    """A cost model from what validate measured: c (drafter step / target step) and the cost of
    its (gamma+1)-token verify in target steps. One verify width cannot separate a round's fixed
    overhead from the per-draft cost, so the verify cost beyond one target step is spread evenly
    over the gamma drafts (exact at the measured width, linear around it).

    A verify that costs less than one target step (on some CPUs a 2-row GEMM streams the weights
    faster than the 1-row GEMV: decode/RESULTS.md, 2026-12-01) is a fixed saving of the wide
    step, `round_overhead` < 0, never a refund per draft: spread over the drafts it priced every
    further draft below nothing, so a long round cost about nothing and the summary's predicted
    speedups ran to absurd figures."""
    if gamma < 1:
        raise ValueError(f"gamma={gamma}: the verify covers at least one draft")
    extra = verify_cost - 1.0  # split as measure.costs_from splits a timed verify line
    return DraftCosts(c=c, verify_per_token=max(extra, 0.0) / gamma, round_overhead=min(extra, 0.0))


def reprice(pred: dict[str, Any], validate: dict[str, Any]) -> dict[str, Any]:
    """The prediction priced with validate's measured costs where the distill stage had none
    (its target was not loaded): same outcomes, calibrated cost model. Unchanged otherwise."""
    c, verify, gamma = validate.get("c"), validate.get("verify_cost"), validate.get("gamma")
    if "outcomes" not in pred or None in (c, verify) or not isinstance(gamma, int) or gamma < 1:
        return pred
    costs = costs_from_validate(float(c), float(verify), gamma)
    rows = unpack_outcomes(pred["outcomes"])
    figures = predict(rows, gamma=int(pred["gamma"]), max_draft=int(pred["max_draft"]), costs=costs)
    source = f"measured by validate (c {c}, a {gamma + 1}-token verify {verify} target steps)"
    return pred | {"costs": dataclasses.asdict(costs) | {"source": source}, "figures": figures}


def measured_costs(tr: Any, drafter, max_draft: int) -> DraftCosts:
    """The pair's step costs, timed with the decoder's own caches on one held-out prompt."""
    from specdistill.decode.draft_length import measure_costs
    from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder

    batch = tr.eval_batches[0]
    first = batch["loss_mask"][0].nonzero()
    end = int(first[0]) + 1 if len(first) else batch["input_ids"].shape[1]
    ids = batch["input_ids"][:1, :end][:, batch["attention_mask"][0, :end].bool()]
    dec = SpeculativeDecoder(
        tr.target, drafter, DecoderConfig(max_new_tokens=8, max_draft=max_draft, gamma=max_draft)
    )
    return measure_costs(dec, ids.to(tr.device))
