"""What a decode returns: the tokens per row, and the counters every report is built from.

p = target, q = drafter, gamma = drafts per round, alpha = acceptance rate (E[sum_x min(p, q)]),
tau = tokens emitted per target forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch


@dataclass
class RoundRecord:
    """One draft/verify round, for online adaptation (p = target, q = drafter).

    `start[r]`: tokens row r had emitted before the round; `next_token`: p's correction or bonus
    token; `target_probs` (B, gamma+1, V): p's raw (temperature-1) softmax, if `record_probs`.
    """

    start: list[int]
    draft: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor
    active: list[bool]
    target_probs: torch.Tensor | None = None
    lengths: list[int] | None = None  # drafts row r verified, when rows differ (confidence stops)


class VerifiedRow(NamedTuple):
    """One row of a verified round as the host reads it (`Verifier.settle`'s one sync).

    `alphas`: each position's figure (greedy: 1.0 where the draft is p's argmax; sampled:
    sum_x min(p, q)); `probs`: sampled only, each draft's min(1, p(x)/q(x)).
    """

    drafts: list[int]
    accepted: int
    next_token: int
    alphas: list[float]
    probs: list[float]

    @classmethod
    def from_host(cls, row: list[float], k: int) -> VerifiedRow:
        """Row r of [drafts (k), accepted, next, alphas (k), probs (k or none)], moved to the host
        in fp32 (token ids < 2^24 are exact)."""
        return cls(
            [int(v) for v in row[:k]], int(row[k]), int(row[k + 1]), row[k + 2 : 2 * k + 2],
            row[2 * k + 2 :],
        )  # fmt: skip

    def emitted(self) -> list[int]:
        """The tokens the round emits for this row: the kept drafts, then the next token."""
        return [*self.drafts[: self.accepted], self.next_token]


@dataclass
class DecodeOutput:
    """New tokens per row (EOS included when hit) and the counters the report is built from."""

    tokens: list[list[int]]
    target_forwards: int = 0  # decode-time forwards of the target (prefill excluded)
    drafter_forwards: int = 0
    rounds: list[RoundRecord] = field(default_factory=list)
    block_tokens: int = 0  # sum over active row-rounds of accepted + 1
    row_rounds: int = 0
    alpha_sum: float = 0.0  # sum over acceptance trials of sum_x min(p, q)
    trials: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # by draft position
    trials_at: list[int] = field(default_factory=list)
    # row-rounds by drafts verified (index 0: plain target steps, a confidence round with none)
    draft_lengths: list[int] = field(default_factory=list)
    # decoder.lookup: rounds whose drafts were copied from the context (decode.lookup), their
    # drafts verified and accepted (also counted in the totals above)
    lookup_rounds: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # the lookup rounds' share of the acceptance counters, so the drafter's own acceptance can
    # be told apart (`drafter_alpha`): lookup drafts can be most of those a decode tests
    lookup_alpha_sum: float = 0.0
    lookup_trials: int = 0
    lookup_accepted_at: list[int] = field(default_factory=list)
    lookup_trials_at: list[int] = field(default_factory=list)
    # each row's own counters (tokens left empty), kept by the decoder: a batch's figures by
    # prompt, so validate can report benchmark categories from batched decodes
    by_row: list[DecodeOutput] = field(default_factory=list)

    @classmethod
    def counting(cls, rows: int, kmax: int) -> DecodeOutput:
        """An empty output for `rows` rows and at most `kmax` drafts a round, per-row counters
        included."""

        def blank() -> DecodeOutput:
            return cls(
                tokens=[],
                accepted_at=[0] * kmax,
                trials_at=[0] * kmax,
                lookup_accepted_at=[0] * kmax,
                lookup_trials_at=[0] * kmax,
                draft_lengths=[0] * (kmax + 1),
            )

        out = blank()
        out.tokens = [[] for _ in range(rows)]
        out.by_row = [blank() for _ in range(rows)]
        return out

    def rows(self) -> list[DecodeOutput]:
        """One output per row (its tokens and its own counters), in row order. An output of one
        row is its own row; a batch needs the counters its decoder kept per row."""
        if len(self.by_row) == len(self.tokens):
            return [replace(r, tokens=[t], by_row=[]) for r, t in zip(self.by_row, self.tokens)]
        if len(self.tokens) == 1:
            return [self]
        raise ValueError(
            f"an output of {len(self.tokens)} rows kept no per-row counters "
            f"({len(self.by_row)} kept): decode it with SpeculativeDecoder.generate"
        )

    @property
    def mean_draft_length(self) -> float:
        return sum(k * n for k, n in enumerate(self.draft_lengths)) / max(self.row_rounds, 1)

    def acceptance_at(self) -> list[float]:
        """Acceptance by draft position, each given the drafts before it were accepted (every
        tested draft: prompt lookup's too), rounded for reports."""
        return [round(a / t, 4) if t else 0.0 for a, t in zip(self.accepted_at, self.trials_at)]

    @property
    def tau(self) -> float:
        return self.block_tokens / max(self.row_rounds, 1)

    @property
    def lookup_round_share(self) -> float:
        """The share of row-rounds whose drafts prompt lookup copied from the context."""
        return round(self.lookup_rounds / max(self.row_rounds, 1), 3)

    @property
    def lookup_acceptance(self) -> float:
        """Share of the verified prompt-lookup drafts the target accepted."""
        return self.lookup_accepted / max(self.lookup_drafted, 1)

    @property
    def alpha(self) -> float:
        """Acceptance of every tested draft, prompt lookup's included."""
        return self.alpha_sum / max(self.trials, 1)

    @property
    def drafter_alpha(self) -> float:
        """Acceptance of the drafter's own drafts (lookup rounds left out): what distillation
        moves, and what the held-out alpha of the distill stage predicts."""
        return (self.alpha_sum - self.lookup_alpha_sum) / max(self.trials - self.lookup_trials, 1)

    @property
    def drafter_trials(self) -> int:
        """The drafter's own tested drafts: 0 makes `drafter_alpha`'s 0.0 no measurement."""
        return self.trials - self.lookup_trials

    def drafter_trials_at(self) -> list[int]:
        """The drafter's own tested drafts by draft position (lookup rounds left out)."""
        look_t = self.lookup_trials_at or [0] * len(self.trials_at)
        return [t - lt for t, lt in zip(self.trials_at, look_t)]

    def drafter_alpha_at(self) -> list[float]:
        """`acceptance_at` for the drafter's own drafts (lookup rounds left out)."""
        look_a = self.lookup_accepted_at or [0] * len(self.accepted_at)
        return [
            (a - la) / t if t > 0 else 0.0
            for a, la, t in zip(self.accepted_at, look_a, self.drafter_trials_at())
        ]

    def count_round(
        self,
        rows: list[VerifiedRow],
        active: list[bool],
        lengths: list[int],
        lookup: bool = False,
    ) -> None:
        """Add one verified round's counters over the rows still decoding (trials stop at the
        first reject; row r verified lengths[r] drafts); lookup: also into the lookup_* ones."""
        if len(self.by_row) == len(rows):
            for r, own in enumerate(self.by_row):
                own.count_round(rows[r : r + 1], active[r : r + 1], lengths[r : r + 1], lookup)
        for row, a, kr in zip(rows, active, lengths):
            if not a:
                continue
            n = row.accepted
            self.row_rounds += 1
            self.block_tokens += n + 1
            self.accepted += n
            self.draft_lengths[kr] += 1
            for j in range(min(n + 1, kr)):  # positions that were put to the test
                self.trials_at[j] += 1
                self.accepted_at[j] += int(j < n)
                self.alpha_sum += row.alphas[j]
                self.trials += 1
                if lookup:
                    self.lookup_trials_at[j] += 1
                    self.lookup_accepted_at[j] += int(j < n)
                    self.lookup_alpha_sum += row.alphas[j]
                    self.lookup_trials += 1


def emitted_tokens(outs: list[DecodeOutput]) -> int:
    """Tokens the decodes emitted, over every row of every output (a rate's numerator)."""
    return sum(len(t) for o in outs for t in o.tokens)
