"""The agreement gate's threshold by drift: strict where the drafter q serves at its best,
relaxed after a shift in the traffic.

The gate (`specdistill.distill.online.update.Updater`) stops steps whose two half-batch
gradients disagree, which protects a drafter already at its optimum on the traffic from
fitting noise. After a shift it also throttles the learning it is there to allow: the replay
buffer is still full of the old segment, and half-batches mix two domains and disagree. The
served acceptance rate alpha is the evidence the gate lacks: while the alpha of the latest `span` requests lies more
than `margin` below the best such alpha seen so far (the reference), the drafter is not at its
optimum on this traffic, and the gate relaxes; once alpha comes back within `margin`, it is
strict again. The reference is a running maximum, not an average that follows the traffic
down: such an average reaches the new, low level within a few updates and would make the gate
strict again before the drafter had learnt the new traffic. Its limit: on traffic whose ceiling
lies below the best level by more than `margin`, the gate stays relaxed for good (the regime in
which ungated updates were measured to help, but without the gate's protection there).

Recency-weighted replay was measured as the alternative and rejected (distill/RESULTS.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def recent_alpha(served: Sequence[tuple[float, int, int]], span: int) -> float | None:
    """alpha over the newest batches that hold the last `span` requests (a batch straddling
    the edge counts whole): sum of alpha over trials. `served`: (alpha_sum, trials, requests)
    per batch, oldest first. None without trials."""
    alpha_sum, trials, requests = 0.0, 0, 0
    for a, t, n in reversed(served):
        if requests >= span:
            break
        alpha_sum, trials, requests = alpha_sum + a, trials + t, requests + n
    return alpha_sum / trials if trials else None


def relax_gate(recent: float | None, reference: float | None, margin: float | None) -> bool:
    """Relax while the recent served alpha lies more than `margin` below the reference."""
    if margin is None or recent is None or reference is None:
        return False
    return recent < reference - margin


class DriftGate:
    """Served alpha per batch and its running best: which updates get the relaxed gate."""

    def __init__(self, margin: float | None, span: int) -> None:
        self.margin, self.span = margin, span
        self.served: deque[tuple[float, int, int]] = deque()
        self.reference: float | None = None

    def observe(self, alpha_sum: float, trials: int, requests: int) -> None:
        """One served batch of the adapted drafter."""
        self.served.append((float(alpha_sum), int(trials), int(requests)))
        while sum(n for _, _, n in self.served) - self.served[0][2] >= self.span:
            self.served.popleft()  # the rest still covers `span` requests

    def decide(self) -> bool:
        """At an update: relax its gate? Then the reference takes the recent alpha in."""
        recent = recent_alpha(self.served, self.span)
        relax = relax_gate(recent, self.reference, self.margin)
        if recent is not None:
            self.reference = recent if self.reference is None else max(self.reference, recent)
        return relax

    def state_dict(self) -> dict:
        return {"served": list(self.served), "reference": self.reference}

    def load_state_dict(self, state: dict) -> None:
        self.served = deque(tuple(b) for b in state["served"])  # type: ignore[misc]
        self.reference = state["reference"]
