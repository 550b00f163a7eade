"""Per-round draft length: how many tokens the drafter q proposes before the target p verifies.

p = target, q = drafter, gamma = drafts per round, c = drafter step / target step.

| module | what it holds |
| --- | --- |
| `costs.py` | pure cost and stopping math: `DraftCosts`, expected-gain rule, step widths |
| `calibration.py` | `Calibration`: acceptance predicted from q's confidence, fitted online |
| `policies.py` | `fixed`, `heuristic`, `confidence` (`make_policy`), the floor of target steps |
| `figures.py` | `replay` (a policy over known outcomes) and a decode's `draft_figures` |
| `measure.py` | `DraftCosts` timed: forwards through the decoder's `step_timer`, the round's glue in its own decodes (`round_glue`) |
| `costs_memo.py` | `CostsMemo`: one run's decoders over the same models share the timed forwards (every serving mode) and the whole costs (the same mode) |

The names below are re-exported so callers import them from `specdistill.decode.draft_length`.
"""

from specdistill.decode.draft_length.calibration import Calibration
from specdistill.decode.draft_length.costs import (
    MIN_OVERHEAD,
    DraftCosts,
    best_length,
    best_more,
    chunk_widths,
    costs_from_mapping,
    draft_gain,
    expected_tokens,
    modeled_speedup,
    verify_widths,
)
from specdistill.decode.draft_length.figures import Replay, draft_figures, replay
from specdistill.decode.draft_length.measure import (
    measure_costs,
    realized_overhead,
    round_glue,
)
from specdistill.decode.draft_length.policies import (
    POLICIES,
    POLICY_CLASSES,
    SCOPES,
    ConfidenceLength,
    DraftLengthPolicy,
    FixedLength,
    HeuristicLength,
    RoundPlan,
    make_policy,
)

__all__ = [
    "MIN_OVERHEAD",
    "POLICIES",
    "POLICY_CLASSES",
    "SCOPES",
    "Calibration",
    "ConfidenceLength",
    "DraftCosts",
    "DraftLengthPolicy",
    "FixedLength",
    "HeuristicLength",
    "Replay",
    "RoundPlan",
    "best_length",
    "best_more",
    "chunk_widths",
    "costs_from_mapping",
    "draft_figures",
    "draft_gain",
    "expected_tokens",
    "make_policy",
    "measure_costs",
    "modeled_speedup",
    "realized_overhead",
    "replay",
    "round_glue",
    "verify_widths",
]
