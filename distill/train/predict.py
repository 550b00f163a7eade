"""The decode figures a drafter will get, predicted from the distill stage's held-out set.

p = target, q = drafter, greedy serving. Along the target's own greedy continuation (eval
source `target`) a round's drafts are accepted exactly as long as q's argmax matches p's, and
while they are, q's context *is* that continuation. So each held-out row's teacher-forced
agreement string fixes every round of a fixed or heuristic-length decode, and `replay` walks
it: a round verifies k drafts, accepts the longest agreeing prefix n <= k and emits n + 1
tokens (the correction or bonus token takes the next position), the next round starting n + 1
positions on. `confidence` also reads q's confidences, which after a rejected draft are the
teacher-forced ones here, not the wrong-context ones the decode sees: an estimate past a
rejection. On reference completions (eval source `reference`) every figure is an estimate.

Figures per policy: tau (tokens per round), mean draft length, acceptance by draft position and
the modeled speedup under a `DraftCosts` (total tokens / total round cost). Nothing is timed:
the costs are `eval.predict.costs`, else the cost model's defaults, labelled uncalibrated, with
the outcomes kept so the summary can `reprice` them with the c and verify cost validate measured.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdistill.decode.config import DecoderConfig
from specdistill.decode.draft_length import (
    POLICIES,
    DraftCosts,
    costs_from_mapping,
    costs_from_steps,
    make_policy,
)

if TYPE_CHECKING:
    from specdistill.distill.train.settings import TrainSettings

DEFAULT_P_MIN = DecoderConfig.p_min  # confidence: the decoder's default cut
UNCALIBRATED = "default, uncalibrated (set eval.predict.costs, or let validate price them)"


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


@dataclass
class Rounds:
    """Rounds replayed over agreement strings: tokens emitted, rounds (target forwards, plain
    target steps included), drafts verified, rounds that verified none, modeled cost in target
    steps, and per draft position j (0-based) the rounds that reached it and accepted it."""

    tokens: int = 0
    rounds: int = 0
    drafts: int = 0
    target_steps: int = 0
    cost: float = 0.0
    trials: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)

    def add(self, other: Rounds) -> Rounds:
        def summed(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]

        return Rounds(
            self.tokens + other.tokens,
            self.rounds + other.rounds,
            self.drafts + other.drafts,
            self.target_steps + other.target_steps,
            self.cost + other.cost,
            summed(self.trials, other.trials),
            summed(self.accepts, other.accepts),
        )

    def figures(self) -> dict[str, Any]:
        """tau, mean drafts verified per round, the share of rounds that verified none,
        acceptance by draft position (accepted / reached) and the modeled speedup over
        target-only decoding (which costs one target step per token)."""
        rounds = max(self.rounds, 1)
        return {
            "tau": round(self.tokens / rounds, 3),
            "mean_draft_length": round(self.drafts / rounds, 3),
            "target_step_share": round(self.target_steps / rounds, 3),
            "acceptance_by_position": [
                round(a / t, 4) for a, t in zip(self.accepts, self.trials) if t
            ],
            "rounds": self.rounds,
            "speedup": round(self.tokens / max(self.cost, 1e-9), 3),
        }


def replay(
    agree: Sequence[bool],
    conf: Sequence[float] | None,
    policy: str,
    *,
    gamma: int,
    max_draft: int,
    p_min: float,
    costs: DraftCosts,
) -> Rounds:
    """One greedy decode of len(agree) tokens along a row's agreement string (agree[t]: q's
    argmax at position t is p's; conf[t]: q's probability of it), its rounds chosen by the
    decoder's own policy object (decode/draft_length/policies.py), asked as the decoder asks it:

    - a round plans at most the tokens left minus one drafts (at least 1);
    - a policy that reads q drafts one at a time and stops once it says so (`keep_drafting`;
      the draft it stopped at is paid, c), then verifies the drafts `lengths` keeps (0 is a
      plain target step); the others verify every draft planned;
    - k verified drafts cost costs.round_cost(k); n accepted emit n + 1 tokens (fewer at the
      string's end), the policy observes (k, n), and the next round starts n + 1 positions on."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: use {', '.join(POLICIES)}")
    n_pos = len(agree)
    if conf is not None and len(conf) != n_pos:
        raise ValueError(f"conf has {len(conf)} positions, agree {n_pos}")
    rule = make_policy(policy, gamma, max_draft, p_min)
    if rule.reads_q and conf is None:
        raise ValueError(f"the {policy} policy reads q's confidences: pass conf")
    most = max_draft if policy == "heuristic" else gamma
    out = Rounds(trials=[0] * most, accepts=[0] * most)
    rule.start(1)
    pos = 0
    while pos < n_pos:
        k = rule.plan(max(1, n_pos - pos - 1))
        drafted, tops = k, None
        if rule.reads_q:
            assert conf is not None
            tops, drafted = [[]], 0
            while drafted < k:
                tops[0].append(conf[pos + drafted])
                drafted += 1
                if not rule.keep_drafting([conf[pos + drafted - 1]], [True]):
                    break
        (verified,) = rule.lengths(tops, drafted, 1)
        n = 0
        while n < verified and agree[pos + n]:
            n += 1
        for j in range(min(n + 1, verified)):
            out.trials[j] += 1
            out.accepts[j] += j < n
        out.rounds += 1
        out.drafts += verified
        out.target_steps += verified == 0
        out.tokens += min(n + 1, n_pos - pos)
        out.cost += costs.round_cost(verified) + costs.c * (drafted - verified)
        rule.observe([verified], [n], [True])
        pos += n + 1
    return out


def predict(
    rows: list[tuple[list[bool], list[float]]],
    *,
    gamma: int,
    max_draft: int,
    p_min: float,
    costs: DraftCosts,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, dict[str, Any]]:
    """`Rounds.figures` per policy over all rows, each row one decode (the heuristic's length
    starts at gamma in every row); fixed is labelled `gamma=G`."""
    knobs = {"gamma": gamma, "max_draft": max_draft, "p_min": p_min, "costs": costs}
    figures: dict[str, dict[str, Any]] = {}
    for name in policies:
        total = Rounds()
        for agree, conf in rows:
            total = total.add(replay(agree, conf, name, **knobs))
        figures[f"gamma={gamma}" if name == "fixed" else name] = total.figures()
    return figures


def heldout_prediction(tr: Any, drafter, s: TrainSettings) -> dict[str, Any] | None:
    """The prediction for the distill result (greedy serving; None otherwise), priced with
    `eval.predict.costs` or, when unset, the cost model's defaults (said so, with the outcomes
    kept for `reprice`). Called only for the objectives whose drafts the replay reads
    (`Objective.predicts_decode`: autoregressive drafts in the target's ids)."""
    pred = s.eval.predict
    if not pred.enabled or not tr.eval_sampling.greedy or not tr.eval_batches:
        return None
    if isinstance(pred.costs, Mapping):
        costs, source = costs_from_mapping(pred.costs), "configured"
    else:
        costs, source = DraftCosts(), UNCALIBRATED
    rows = heldout_outcomes(drafter, tr.target, tr.eval_batches, vocab=tr.vocab, device=tr.device)
    knobs = {"gamma": pred.gamma, "max_draft": pred.max_draft, "p_min": pred.p_min}
    out = {
        "eval_source": s.eval.source,
        "exact": s.eval.source == "target",
        "costs": dataclasses.asdict(costs) | {"source": source},
        "rows": len(rows),
        **knobs,
        "figures": predict(rows, **knobs, costs=costs),
    }
    if source == UNCALIBRATED:  # kept so validate's measured costs can price them
        out["outcomes"] = pack_outcomes(rows)
    return out


def pack_outcomes(rows: list[tuple[list[bool], list[float]]]) -> list[list[Any]]:
    """Rows as JSON: the agreement string ("1" = q's argmax was p's) and q's confidences."""
    return [
        ["".join("1" if a else "0" for a in agree), [round(c, 4) for c in conf]]
        for agree, conf in rows
    ]


def unpack_outcomes(packed: list[list[Any]]) -> list[tuple[list[bool], list[float]]]:
    """The inverse of `pack_outcomes` (confidences rounded to 4 digits)."""
    return [([ch == "1" for ch in agree], [float(c) for c in conf]) for agree, conf in packed]


def reprice(pred: dict[str, Any], validate: dict[str, Any]) -> dict[str, Any]:
    """The prediction priced with validate's measured costs where the distill stage had none
    configured: same outcomes, calibrated cost model. Unchanged otherwise."""
    c, verify, gamma = validate.get("c"), validate.get("verify_cost"), validate.get("gamma")
    if "outcomes" not in pred or None in (c, verify) or not isinstance(gamma, int) or gamma < 1:
        return pred
    costs = costs_from_steps(float(c), float(verify), gamma)
    rows = unpack_outcomes(pred["outcomes"])
    figures = predict(
        rows,
        gamma=int(pred["gamma"]),
        max_draft=int(pred["max_draft"]),
        p_min=float(pred.get("p_min", DEFAULT_P_MIN)),
        costs=costs,
    )
    source = f"measured by validate (c {c}, a {gamma + 1}-token verify {verify} target steps)"
    return pred | {"costs": dataclasses.asdict(costs) | {"source": source}, "figures": figures}
