"""Per-round draft length and its cost model (p = target, q = drafter, c = drafter step /
target step): `costs.py` (pure: expected tokens, modeled speedup, the recommended K) and
`policies.py` (fixed, heuristic, confidence: deterministic, no timing)."""

from specdistill.decode.draft_length.costs import (
    DraftCosts,
    chunk_widths,
    costs_from_mapping,
    costs_from_steps,
    expected_tokens,
    recommend_k,
    speedup_at,
    speedup_table,
    verify_widths,
)
from specdistill.decode.draft_length.policies import (
    POLICIES,
    POLICY_CLASSES,
    ConfidenceLength,
    DraftLengthPolicy,
    HeuristicLength,
    make_policy,
)

__all__ = [
    "POLICIES",
    "POLICY_CLASSES",
    "ConfidenceLength",
    "DraftCosts",
    "DraftLengthPolicy",
    "HeuristicLength",
    "chunk_widths",
    "costs_from_mapping",
    "costs_from_steps",
    "expected_tokens",
    "make_policy",
    "recommend_k",
    "speedup_at",
    "speedup_table",
    "verify_widths",
]
