"""Draft-length figures: a policy replayed over known outcomes, and a decode's figures.

p = target, q = drafter. `replay` runs the decoder's own policy objects over a greedy decode
whose per-position acceptance is known (the distill stage's held-out prediction);
`draft_figures` summarises the draft lengths of a real decode for the reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdistill.decode.draft_length.costs import DraftCosts
from specdistill.decode.draft_length.policies import DraftLengthPolicy


@dataclass
class Replay:
    """A policy replayed over known acceptance outcomes (`replay`): tokens emitted, modeled cost
    in target steps, rounds that drafted, drafts verified, plain target steps."""

    tokens: int = 0
    cost: float = 0.0
    rounds: int = 0
    drafts: int = 0
    target_steps: int = 0

    def add(self, other: Replay) -> Replay:
        return Replay(*(getattr(self, f) + getattr(other, f) for f in Replay.__dataclass_fields__))

    def figures(self) -> dict[str, float]:
        """tau (tokens per target forward), mean drafts per round (target steps count 0) and
        the speedup the cost model gives (target-only decoding costs 1 per token)."""
        forwards = max(self.rounds + self.target_steps, 1)
        return {
            "tau": round(self.tokens / forwards, 3),
            "mean_draft_length": round(self.drafts / forwards, 3),
            "target_step_share": round(self.target_steps / forwards, 3),
            "speedup": round(self.tokens / max(self.cost, 1e-9), 3),
        }


def replay(
    accepted: Sequence[bool], conf: Sequence[float] | None, policy: DraftLengthPolicy
) -> Replay:
    """Run `policy` over one greedy decode whose per-position outcomes are known: accepted[t]
    is whether the drafter's argmax at t matches the target's token there (teacher-forced on the
    target's own greedy continuation), conf[t] the drafter's probability of its argmax.

    Exact for greedy decoding up to the first rejection of every round, which is all that
    fixed and heuristic lengths read: while drafts are accepted the drafter's context *is* the
    target's continuation. A confidence policy may also read confidences after a rejected draft,
    where the real drafter saw its own wrong token: those are the teacher-forced ones here. The
    floor's plain steps are judged as the decoder's next catch-up judges them (`observe_shadow`).
    This is how the distill stage predicts the adaptive speedup from its held-out set."""
    n = len(accepted)
    if conf is not None and len(conf) != n:
        raise ValueError(f"conf has {len(conf)} positions, accepted {n}")
    out = Replay()
    policy.start(1)
    pos, skipped = 0, []
    while pos < n:
        budget = max(1, min(policy.max_k, n - pos - 1))
        k = policy.plan(budget, [True]).k
        if k == 0:
            policy.observe_step([True])
            out.target_steps += 1
            out.tokens += 1
            out.cost += 1.0
            skipped.append(pos)
            pos += 1
            continue
        kd = k
        if policy.reads_q and conf is not None:
            for i in range(k - 1):
                if not policy.keep_drafting(i + 1, [conf[min(pos + i, n - 1)]]):
                    kd = i + 1
                    break
        if skipped and policy.floor:  # the drafter's catch-up read them: their verdicts
            policy.observe_shadow([[float(accepted[j]) for j in skipped]], [True], pairs=True)
        skipped = []
        got = 0
        while got < kd and pos + got < n and accepted[pos + got]:
            got += 1
        out.rounds += 1
        out.drafts += kd
        out.tokens += min(got + 1, n - pos)
        out.cost += policy.costs.round_cost(kd)
        window = [list(conf[pos : pos + kd])] if conf is not None else None
        policy.observe([kd], [got], [True], window)
        pos += got + 1
    return out


def draft_figures(out, costs: DraftCosts | None = None) -> dict:
    """Draft-length figures of a decode (`DecodeOutput`): mean drafts per row-round (plain
    target steps count as 0), the share of plain target steps, the histogram by drafts verified,
    drafter forwards per emitted token, and the step costs an adaptive policy planned with."""
    rounds = max(out.row_rounds, 1)
    figures = {
        "mean_draft_length": round(out.mean_draft_length, 3),
        "target_step_share": round(out.draft_lengths[0] / rounds, 3) if out.draft_lengths else 0.0,
        "draft_lengths": list(out.draft_lengths),
        "drafter_forwards_per_token": round(
            out.drafter_forwards / max(sum(len(t) for t in out.tokens), 1), 3
        ),
    }
    if out.lookup_rounds:  # decoder.lookup: the rounds whose drafts came from the context
        figures["lookup"] = {
            "rounds": out.lookup_rounds,
            "round_share": round(out.lookup_rounds / rounds, 3),
            "drafted": out.lookup_drafted,
            "accepted": out.lookup_accepted,
            "acceptance": round(out.lookup_acceptance, 4),
        }
    if costs is not None:
        figures["draft_costs"] = {
            "c": costs.c,
            "verify_per_token": costs.verify_per_token,
            "round_overhead": costs.round_overhead,
            "glue_per_draft": costs.glue_per_draft,
        }
        if costs.parallel:
            figures["draft_costs"]["draft_per_token"] = costs.draft_per_token
        if costs.prefill_per_token or costs.prefill_fixed:  # the drafter's lazy prefill
            figures["draft_costs"]["prefill_per_token"] = costs.prefill_per_token
            figures["draft_costs"]["prefill_fixed"] = costs.prefill_fixed
        if costs.verify_tokens:  # decoder.verify_costs=by_width: each width as timed
            figures["draft_costs"]["verify_tokens"] = list(costs.verify_tokens)
    return figures
