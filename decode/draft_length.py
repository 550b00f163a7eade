"""Per-round draft length: how many tokens the drafter q proposes before the target p verifies.

p = target, q = drafter. A fixed gamma pays gamma drafter steps every round however poor the
drafts; these policies choose the length round by round from what the decoder already knows,
and fall back to plain target steps (a round with 0 drafts) when drafting does not pay.

Lossless by construction: a policy reads the drafter's own distributions q and the outcomes of
*earlier* rounds, never the target's p of the round being drafted, so the acceptance rule stays
exact for whatever length it picks (a length is just a stopping time of the draft; tests check
greedy identity and the sampled distribution with a chi-square test).

Cost model (units: one 1-token target step; `DraftCosts`): a round with k >= 1 drafts costs
k c (drafter steps; one forward in all for a parallel drafter) + 1 + `round_overhead` +
k `verify_per_token` (the (k+1)-token verify and the round's glue); a round with 0 drafts is a
plain target step and costs 1.

Expected-gain rule (`draft_gain`). With acceptance probabilities a_1..a_k of the drafts (each
given that the ones before were accepted), a round emits E = 1 + sum_j prod_{i<=j} a_i tokens.
Throughput over many rounds is tokens / time, and a rule maximises it when each round maximises
E - R * cost, R being the throughput achievable (Dinkelbach; R >= 1 since target-only decoding
is always there). After j drafts, whose prefix is accepted with probability P_j, drafting m more
with predicted acceptance a each returns P_j (a + a^2 + ... + a^m) tokens and costs
R (cost(j+m) - cost(j)): draft on while some m >= 1 has a positive net gain. Before a round
(j = 0, P_0 = 1) the same comparison decides between drafting and a plain target step: the floor.

Policies (`decoder.draft_length`):
- `fixed`: gamma drafts every round (the decoder's classic behaviour).
- `confidence`: the expected-gain rule, with acceptance predicted by `Calibration`, a logistic
  model of the drafter's confidence (its probability of the token it drafted: q only) and the
  row's recent acceptance, fitted to the acceptance history of the decoder's lifetime: `accept`
  (this draft, given the ones before were accepted) gives P_j, `follow` (the next draft, given
  this one was accepted) the a of the drafts not yet run. Drafters are rarely calibrated: the
  toy drafters' probabilities are flat (a distilled one's 0.03 means ~80% acceptance).
- `heuristic`: `transformers`' assisted-generation schedule: start at gamma, +2 after a round
  whose drafts were all accepted, -1 (at least 1) otherwise.
Both adaptive policies draft at most `max_draft` per round and have the floor (`draft_floor`):
before each round the rule above, with the row's moving averages of first-draft and later-draft
acceptance, decides between drafting and a plain target step; once a target step wins, the next
`interval` rounds are target steps, then a probe round drafts (the drafter catches up on the
skipped tokens in one forward). A probe that does not pay for itself doubles the interval (up to
8 probe_every, carried from call to call), one that does resets it to `probe_every`.

Batches (`draft_scope`): `batch` picks one length for all rows from their summed gains (a batched
drafter step costs the same however many rows use it); `row` lets each row stop on its own
(the batch drafts while any row goes on, each row verifies only its own drafts).

Parallel drafting (one drafter forward proposes all gamma tokens) fits the same functions: the
drafter cost no longer grows with k (`DraftCosts.parallel`), and `best_length` picks how many of
the proposals to verify from their known confidences.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

POLICIES = ("fixed", "heuristic", "confidence")
SCOPES = ("batch", "row")


@dataclass(frozen=True)
class DraftCosts:
    """Round costs in 1-token target steps (p = target, q = drafter).

    c: one drafter step; verify_per_token: what each draft adds to the verify step;
    round_overhead: a speculative round's fixed cost beyond one target step (the verify's
    first token and the round's host-side glue); negative where a 2-token verify costs less than
    a 1-token step (on CPU a 2-row GEMM can stream weights faster than the 1-row GEMV: SmolLM2's
    target, 46 vs 60 ms); parallel: one drafter forward drafts any k.
    """

    c: float = 0.4
    verify_per_token: float = 0.05
    round_overhead: float = 0.15
    parallel: bool = False
    # parallel: what each proposal beyond the first adds to the one drafter forward (a mask)
    draft_per_token: float = 0.0

    def round_cost(self, k: int) -> float:
        """Cost of a round with k drafts (k = 0: a plain target step, cost 1)."""
        if k <= 0:
            return 1.0
        drafting = self.c + (k - 1) * self.draft_per_token if self.parallel else k * self.c
        return drafting + 1.0 + self.round_overhead + k * self.verify_per_token


def expected_tokens(accept: Sequence[float]) -> float:
    """Tokens a round emits on average: 1 + sum_j prod_{i<=j} a_i (a_j: acceptance of draft j
    given drafts 1..j-1 were accepted; the 1 is the correction or bonus token)."""
    total, prefix = 1.0, 1.0
    for a in accept:
        prefix *= a
        total += prefix
    return total


def draft_gain(
    prefix_prob: torch.Tensor,
    next_accept: torch.Tensor,
    drafted: int,
    max_k: int,
    costs: DraftCosts,
    rate: torch.Tensor,
    first_accept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Net expected gain (tokens - rate * cost) of drafting m = 0..max_k-drafted more tokens.

    prefix_prob (B,): probability that the `drafted` drafts so far are all accepted; the next
    draft is accepted with probability first_accept (B,) (default next_accept), each one after it
    with next_accept (B,); rate (B,): throughput to beat (tokens per target step).
    Returns (B, M+1) gains, column m for m more drafts, column 0 being 0.
    """
    m = max(max_k - drafted, 0)
    a = next_accept.double().clamp(0.0, 1.0)[:, None]
    first = a if first_accept is None else first_accept.double().clamp(0.0, 1.0)[:, None]
    steps = torch.arange(m, dtype=torch.float64)
    # P(the first l more drafts are all accepted), l = 1..m
    reach = first * a**steps
    tokens = reach.cumsum(-1) * prefix_prob.double()[:, None]  # (B, M)
    base = costs.round_cost(drafted)
    extra = torch.tensor(
        [costs.round_cost(drafted + i) - base for i in range(1, m + 1)], dtype=torch.float64
    )
    gains = tokens - rate.double()[:, None] * extra
    return torch.cat([torch.zeros_like(gains[:, :1]), gains], 1)


def best_length(accept: Sequence[float], costs: DraftCosts, rate: float = 1.0) -> int:
    """k in 0..len(accept) maximising E_k - rate * cost(k) when every draft's acceptance is known
    (parallel drafting: verify the k best-paying proposals of one forward)."""
    best, best_v = 0, 1.0 - rate * costs.round_cost(0)
    for k in range(1, len(accept) + 1):
        v = expected_tokens(accept[:k]) - rate * costs.round_cost(k)
        if v > best_v + 1e-12:
            best, best_v = k, v
    return best


def _logit(x: float) -> float:
    c = min(max(x, 1e-6), 1 - 1e-6)
    return math.log(c / (1 - c))


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def best_more(
    prefix: float,
    first: float,
    nxt: float,
    increments: Sequence[float],
    rate: float,
) -> tuple[int, float]:
    """`draft_gain` for one row in plain floats (the decoder calls it per drafter step, where
    tensor ops on a few numbers would cost more than the arithmetic): the best number of further
    drafts m and its net gain; increments[i] = cost(drafted + i + 1) - cost(drafted)."""
    best, best_g, reach, tokens = 0, 0.0, prefix * first, 0.0
    for i, inc in enumerate(increments):
        if i:
            reach *= nxt
        tokens += reach
        g = tokens - rate * inc
        if g > best_g + 1e-12:
            best, best_g = i + 1, g
    return best, best_g


class Calibration:
    """P(draft accepted | drafter confidence, recent acceptance), learned from the history.

    A logistic model sigmoid(w0 + w1 logit(conf) + w2 logit(recent)): conf is the drafter's
    probability of its draft (q only), recent the row's moving average of acceptance over earlier
    rounds. Fitted by damped Newton steps to the last `window` observations every `refit_every`
    new ones, with a Gaussian prior of weight `prior` centred on (0, 1/2, 1/2). Drafters are
    rarely calibrated (the toy drafters' probabilities are flat: a distilled one's 0.05 means ~80%
    acceptance) and a sequence's acceptance comes in runs, so the fit learns what each says.
    """

    def __init__(self, prior: float = 4.0, window: int = 2048, refit_every: int = 128) -> None:
        self.prior, self.window, self.refit_every = prior, window, refit_every
        self.w0 = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
        self.w = self.w0.clone()
        self._wf = self.w.tolist()
        # observations as flat float64 arrays (the fit views them as tensors without a copy)
        self.lc, self.lr, self.y = array("d"), array("d"), array("d")
        self._new = 0

    def __call__(self, conf: float, recent: float) -> float:
        w = self._wf
        return _sigmoid(w[0] + w[1] * _logit(conf) + w[2] * _logit(recent))

    def update(self, conf: Sequence[float], recent: Sequence[float], accepted: Sequence[float]):
        self.lc.extend(_logit(c) for c in conf)
        self.lr.extend(_logit(r) for r in recent)
        self.y.extend(float(a) for a in accepted)
        self._new += len(conf)
        if len(self.y) > 2 * self.window:
            for buf in (self.lc, self.lr, self.y):
                del buf[: -self.window]
        # refit often while the history is short, every `refit_every` observations later
        if self._new >= min(self.refit_every, max(16, len(self.y) // 2)):
            self._new = 0
            self.fit()

    def set_prior(self, w0: torch.Tensor) -> None:
        """Move the prior's centre (used at the next fit; taken as is without data)."""
        self.w0 = w0.clone()
        if not self.y:
            self.w = self.w0.clone()
            self._wf = self.w.tolist()

    def fit(self, steps: int = 8) -> None:
        """Damped Newton steps on the penalised log-likelihood (prior: N(w0, 1/prior) per
        weight); a step is halved until the objective falls (plain Newton overshoots when the
        confidences span a narrow range)."""
        if not self.y:
            return
        cols = [
            torch.frombuffer(b, dtype=torch.float64)[-self.window :] for b in (self.lc, self.lr)
        ]
        x = torch.stack([torch.ones_like(cols[0]), *cols], 1)
        y = torch.frombuffer(self.y, dtype=torch.float64)[-self.window :].clone()
        eye = torch.eye(x.shape[1], dtype=x.dtype)

        def loss(w: torch.Tensor) -> float:
            z = x @ w
            nll = torch.nn.functional.softplus(z) - y * z
            return float(nll.sum() + 0.5 * self.prior * ((w - self.w0) ** 2).sum())

        w, cur = self.w, loss(self.w)
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            grad = x.T @ (p - y) + self.prior * (w - self.w0)
            hess = (x * (p * (1 - p))[:, None]).T @ x + self.prior * eye
            step = torch.linalg.solve(hess, grad)
            for _ in range(20):
                new = loss(w - step)
                if new <= cur:
                    break
                step = step / 2
            else:
                break
            w, cur = w - step, new
            if float(step.abs().max()) < 1e-6:
                break
        self.w = w
        self._wf = w.tolist()


@dataclass
class RoundPlan:
    """What a round drafts: at most `k` tokens (0: a plain target step); `probe` marks a floor
    probe."""

    k: int
    probe: bool = False


class DraftLengthPolicy:
    """Base: a fixed gamma. Subclasses choose k per round; the decoder calls, per generate:
    `start(B)`, then per round `plan(budget, active)`, `keep_drafting(j, conf)` after each draft
    (only when `reads_q`), `lengths(k)`, then `observe(...)` after a verify or `observe_step`
    after a plain target step. Plain Python on a few floats per row: these run every drafter
    step, where tensor ops on tiny tensors would cost a sizeable share of a step.

    What the floor knows (per row, from earlier rounds only): `first` and `follow`, moving
    averages of the acceptance of a round's first draft and of the drafts after it, and the
    realized throughput (tokens per modeled cost, at least 1).
    """

    reads_q = False
    max_backoff = 8  # a floor's probe interval grows to at most this many probe_every
    ema = 0.3  # `recent`, the calibration's history feature
    floor_ema = 0.1  # `first` / `follow`, what the floor decides on: slower, a few misses at a
    # sequence's start should not switch a good drafter off (measured: 0.3 did, on the toy pair)

    def __init__(
        self,
        gamma: int,
        max_k: int,
        costs: DraftCosts,
        scope: str = "batch",
        floor: bool = True,
        probe_every: int = 8,
    ) -> None:
        self.gamma, self.max_k = gamma, max_k
        self.scope, self.floor, self.probe_every = scope, floor, probe_every
        self.set_costs(costs)
        self.interval = probe_every  # plain target steps between floor probes (backs off)
        # consecutive plain target steps, carried from call to call: with a backed-off interval
        # longer than one decode, a per-call count would never reach a probe again
        self.skipped = 0
        # lifetime counts (accepted, tested): the next call's starting averages
        self._life = {"first": [0.0, 0.0], "follow": [0.0, 0.0], "all": [0.0, 0.0]}

    def set_costs(self, costs: DraftCosts) -> None:
        """Plan with these step costs (the decoder sets them per batch size)."""
        if getattr(self, "costs", None) == costs:
            return
        self.costs = costs
        # increments[d][i] = cost(d + i + 1) - cost(d): the extra cost of i + 1 more drafts
        self.increments = [
            [costs.round_cost(d + i) - costs.round_cost(d) for i in range(1, self.max_k - d + 1)]
            for d in range(self.max_k + 1)
        ]

    def _prior(self, key: str) -> float:
        hits, seen = self._life[key]
        return (hits + 0.5 * 2) / (seen + 2)  # 0.5 before any history

    # -- per generate call
    def start(self, batch: int) -> None:
        self.b = batch
        self.first = [self._prior("first")] * batch
        self.follow = [self._prior("follow")] * batch
        self.recent = [self._prior("all")] * batch
        self.tokens = [1.0] * batch  # realized tokens and modeled cost (a prior of one step)
        self.cost = [1.0] * batch
        self.probing = False  # `interval` and `skipped` carry over from the last call
        self.row_k: list[int] | None = None

    def rate(self, r: int) -> float:
        """Throughput to beat for row r: realized tokens per modeled cost so far, at least 1."""
        return max(1.0, self.tokens[r] / self.cost[r])

    def _best_m(self, active: list[bool]) -> int:
        """The number of drafts m >= 0 that pays best at the rows' recent acceptance (0: a
        target step beats every m). Batch scope: gains summed over the active rows; row scope:
        the most any active row wants."""
        inc = self.increments[0]
        if self.scope == "row":
            return max(
                (
                    best_more(1.0, self.first[r], self.follow[r], inc, self.rate(r))[0]
                    for r in range(self.b)
                    if active[r]
                ),
                default=0,
            )
        total = [0.0] * len(inc)
        for r in range(self.b):
            if active[r]:
                reach, tokens, rate = self.first[r], 0.0, self.rate(r)
                for i, c in enumerate(inc):
                    if i:
                        reach *= self.follow[r]
                    tokens += reach
                    total[i] += tokens - rate * c
        best = max(range(len(total)), key=total.__getitem__, default=-1)
        return best + 1 if best >= 0 and total[best] > 1e-12 else 0

    def _pays(self, active: list[bool]) -> bool:
        """Does drafting (some m >= 1 drafts at the rows' recent acceptance) beat a target step?"""
        return self._best_m(active) > 0

    def plan(self, budget: int, active: list[bool]) -> RoundPlan:
        """Before drafting: this round's most drafts (<= budget), 0 for a plain target step.
        Once the floor engages it holds for `interval` steps (nothing new is learnt during
        them), then a probe round drafts; a probe that did not pay for itself doubles the
        interval (up to `max_backoff` probe_every), one that did resets it."""
        if not self.floor:
            return RoundPlan(self._k(budget))
        if 0 < self.skipped < self.interval:
            self.skipped += 1
            return RoundPlan(0)
        if self.skipped:  # a probe is due
            self.skipped, self.probing = 0, True
            return RoundPlan(self._k(budget), probe=True)
        if self._pays(active):
            return RoundPlan(self._k(budget))
        self.skipped = 1
        return RoundPlan(0)

    def _k(self, budget: int) -> int:
        return min(self.gamma, budget)

    def observe_step(self, active: list[bool]) -> None:
        """After a plain target step: one token for one target step per active row."""
        for r, a in enumerate(active):
            if a:
                self.tokens[r] += 1.0
                self.cost[r] += 1.0

    def keep_drafting(self, drafted: int, conf: list[float]) -> bool:
        return True

    def lengths(self, k: int) -> list[int]:
        """Drafts each row verifies this round (row scope may cut rows short)."""
        return [k] * self.b if self.row_k is None else [min(x, k) for x in self.row_k]

    def observe(
        self,
        lengths: list[int],
        accepted: list[int],
        active: list[bool],
        conf: list[list[float]] | None,
    ) -> None:
        """After the verify: row r verified lengths[r] drafts and accepted accepted[r]; conf
        (B lists of K): the drafter's confidence per draft (confidence policy)."""
        k = max(lengths) if lengths else 0
        cost = self.costs.round_cost(k)
        e, fe = self.ema, self.floor_ema
        life = self._life
        if self.probing:  # did the probe pay for itself (tokens >= cost in target steps)?
            self.probing = False
            got = sum(n + 1 for n, a in zip(accepted, active) if a)
            paid = got >= cost * sum(active)
            backoff = min(2 * self.interval, self.max_backoff * self.probe_every)
            self.interval = self.probe_every if paid else backoff
        for r, a in enumerate(active):
            if not a:
                continue
            n, kr = accepted[r], lengths[r]
            self.tokens[r] += n + 1
            self.cost[r] += cost
            for j in range(min(n + 1, kr)):  # positions put to the test
                ok = 1.0 if j < n else 0.0
                if j == 0:
                    self.first[r] = (1 - fe) * self.first[r] + fe * ok
                    key = "first"
                else:
                    self.follow[r] = (1 - fe) * self.follow[r] + fe * ok
                    key = "follow"
                self.recent[r] = (1 - e) * self.recent[r] + e * ok
                life[key][0] += ok
                life[key][1] += 1
                life["all"][0] += ok
                life["all"][1] += 1
        self.row_k = None


class FixedLength(DraftLengthPolicy):
    """gamma drafts every round, no floor (the classic decoder)."""

    def __init__(self, gamma: int, max_k: int, costs: DraftCosts, **_) -> None:
        super().__init__(gamma, max_k, costs, floor=False)


class HeuristicLength(DraftLengthPolicy):
    """`transformers`' schedule: +2 when a round's drafts were all accepted, else -1 (>= 1)."""

    def start(self, batch: int) -> None:
        super().start(batch)
        self.n = [min(self.gamma, self.max_k)] * batch

    def _k(self, budget: int) -> int:
        if self.scope == "row":
            self.row_k = list(self.n)
            return min(max(self.n), budget)
        return min(self.n[0], budget)

    def observe(self, lengths, accepted, active, conf) -> None:
        super().observe(lengths, accepted, active, conf)
        k = max(lengths) if lengths else 0
        if k == 0:
            return
        if self.scope == "row":
            for r, a in enumerate(active):
                if a:
                    full = accepted[r] >= lengths[r]
                    self.n[r] = min(self.max_k, self.n[r] + 2) if full else max(1, self.n[r] - 1)
            return
        full = all(n >= kr for n, kr, a in zip(accepted, lengths, active) if a)
        n = min(self.max_k, self.n[0] + 2) if full else max(1, self.n[0] - 1)
        self.n = [n] * self.b


class ConfidenceLength(DraftLengthPolicy):
    """The expected-gain rule on the drafter's calibrated confidence (see the module docstring).

    Two calibrations, of q and earlier rounds only: `accept` maps a draft's confidence (and the
    row's recent acceptance) to its acceptance given the drafts before it were accepted, `follow`
    maps them to the acceptance of the *next* draft given this one was accepted, which is what
    the decision to spend another drafter step needs before that step runs; `follow`'s prior is
    `accept`'s fit (the next draft predicted like this one until the history says otherwise).
    """

    reads_q = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.accept = Calibration()
        self.follow_cal = Calibration()
        # parallel drafting: one calibration per draft depth (a mask's confidence means less
        # than the first draft's); depth d's prior is depth d-1's fit
        self.depth = [Calibration() for _ in range(self.max_k)]

    spare = 2  # parallel: proposals beyond the running averages' best m (see `_k`)

    def plan(self, budget: int, active: list[bool]) -> RoundPlan:
        self.prefix = [1.0] * self.b
        self.r0 = list(self.recent)  # the history this round's predictions read
        self.going = list(active)  # rows still drafting (finished rows never are)
        self.active = active
        self.row_k = [budget] * self.b if self.scope == "row" else None
        return super().plan(budget, active)

    def _k(self, budget: int) -> int:
        """Autoregressive: up to max_k, `keep_drafting` stops. Parallel: the proposals of the
        one forward, the best m at the rows' running acceptance plus `spare` (a proposal costs
        `draft_per_token`, a mask in the forward, far less than verifying it), which the
        confidences may then verify in a confident round."""
        if not self.costs.parallel:
            return min(self.max_k, budget)
        return max(1, min(self.max_k, budget, self._best_m(self.active) + self.spare))

    def keep_drafting(self, drafted: int, conf: list[float]) -> bool:
        """After `drafted` drafts, the latest with confidence conf[r] per row: draft another?"""
        inc = self.increments[drafted]
        total, going = 0.0, False
        for r in range(self.b):
            if not self.going[r]:
                continue
            self.prefix[r] *= self.accept(conf[r], self.r0[r])
            a = self.follow_cal(conf[r], self.r0[r])
            m, g = best_more(self.prefix[r], a, a, inc, self.rate(r))
            if self.scope == "batch":
                total += g  # the batch goes on while the rows' summed gain is positive
            elif m:
                going = True
            else:
                assert self.row_k is not None
                self.row_k[r] = drafted
                self.going[r] = False
        return total > 1e-12 if self.scope == "batch" else going

    def verify_lengths(self, conf: list[list[float]], active: list[bool]) -> list[int]:
        """Parallel drafting: all k proposals of a row and their confidences conf[r] are known
        before the verify, so choose how many to verify (>= 1; the drafter forward is paid) by
        E_L - rate * cost(L) over L = 1..k, with draft j's acceptance given the ones before
        predicted by depth j's calibration. Batch scope: one L for the batch from the rows'
        summed gains; row scope: each row its own."""
        k = len(conf[0]) if conf else 0
        inc = [self.costs.round_cost(j) - self.costs.round_cost(1) for j in range(1, k + 1)]
        gains = []
        for r in range(self.b):
            if not active[r]:
                gains.append(None)
                continue
            rate, reach, tokens, row = self.rate(r), 1.0, 0.0, []
            for j in range(k):
                reach *= self.depth[j](conf[r][j], self.r0[r])
                tokens += reach
                row.append(tokens - rate * inc[j])
            gains.append(row)
        if self.scope == "row":
            self.row_k = [1 + max(range(k), key=g.__getitem__) if g else 1 for g in gains]
            return list(self.row_k)
        total = [sum(g[j] for g in gains if g) for j in range(k)]
        best = 1 + max(range(k), key=total.__getitem__) if k else 0
        return [best] * self.b

    def observe(self, lengths, accepted, active, conf) -> None:
        if conf and self.costs.parallel:
            self._observe_depths(lengths, accepted, active, conf)
            super().observe(lengths, accepted, active, None)
            return
        if conf:
            cs, rs, oks, fc, fr, fok = [], [], [], [], [], []
            for r, a in enumerate(active):
                if not a:
                    continue
                n, t = accepted[r], min(accepted[r] + 1, lengths[r])
                cs += conf[r][:t]
                rs += [self.r0[r]] * t
                oks += [1.0 if j < n else 0.0 for j in range(t)]
                # pairs (confidence of an accepted draft, was the next one accepted?)
                f = max(min(n, lengths[r] - 1), 0)
                fc += conf[r][:f]
                fr += [self.r0[r]] * f
                fok += [1.0 if j < n else 0.0 for j in range(1, f + 1)]
            self.accept.update(cs, rs, oks)
            # without evidence of its own, the next draft is predicted like this one
            self.follow_cal.set_prior(self.accept.w)
            self.follow_cal.update(fc, fr, fok)
        super().observe(lengths, accepted, active, conf)

    def _observe_depths(self, lengths, accepted, active, conf) -> None:
        """Each depth's calibration learns from the drafts put to the test at that depth (the
        ones whose predecessors were all accepted), with the depth before's fit as its prior."""
        per = [([], [], []) for _ in self.depth]
        for r, a in enumerate(active):
            if not a:
                continue
            n = accepted[r]
            for j in range(min(n + 1, lengths[r])):
                c, rs, ok = per[j]
                c.append(conf[r][j])
                rs.append(self.r0[r])
                ok.append(1.0 if j < n else 0.0)
        for j, (c, rs, ok) in enumerate(per):
            if j:
                self.depth[j].set_prior(self.depth[j - 1].w)
            if c:
                self.depth[j].update(c, rs, ok)


POLICY_CLASSES: dict[str, type[DraftLengthPolicy]] = {
    "fixed": FixedLength,
    "heuristic": HeuristicLength,
    "confidence": ConfidenceLength,
}


def make_policy(
    name: str, gamma: int, max_k: int, costs: DraftCosts, **options
) -> DraftLengthPolicy:
    """`decoder.draft_length` -> its policy; options: scope, floor, probe_every."""
    return POLICY_CLASSES[name](gamma, max_k, costs, **options)


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
    where the real drafter saw its own wrong token: those are the teacher-forced ones here.
    This is how the distill stage predicts the adaptive speedup from its held-out set."""
    n = len(accepted)
    if conf is not None and len(conf) != n:
        raise ValueError(f"conf has {len(conf)} positions, accepted {n}")
    out = Replay()
    policy.start(1)
    pos = 0
    while pos < n:
        budget = max(1, min(policy.max_k, n - pos - 1))
        k = policy.plan(budget, [True]).k
        if k == 0:
            policy.observe_step([True])
            out.target_steps += 1
            out.tokens += 1
            out.cost += 1.0
            pos += 1
            continue
        kd = k
        if policy.reads_q and conf is not None:
            for i in range(k - 1):
                if not policy.keep_drafting(i + 1, [conf[min(pos + i, n - 1)]]):
                    kd = i + 1
                    break
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


def verify_widths(max_k: int) -> list[int]:
    """Verify widths (drafts + 1) a compiled target is given: k in {0, 1, 2, 4, 8, ...} and
    max_k, so CUDA graphs / inductor see a few shapes; a round's drafts are padded up."""
    ks = {0, max_k} | {1 << i for i in range(int(math.log2(max(max_k, 1))) + 1)}
    return sorted(k + 1 for k in ks if k <= max_k)


def chunk_widths(n: int, max_width: int = 16) -> list[int]:
    """Split an n-token drafter catch-up into few shapes: powers of two, largest first."""
    out = []
    while n > 0:
        w = min(1 << (n.bit_length() - 1), max_width)
        out.append(w)
        n -= w
    return out


# A speculative round's host-side glue beyond a plain target step's (verdict, host sync of the
# drafts, bookkeeping, cache rollback), in target steps: measured on the toy pair on CPU.
ROUND_GLUE = 0.1
# The verify's first token may cost less than a 1-token step (round_overhead < 0), within reason:
# a timing below this is noise, not a kernel.
MIN_OVERHEAD = -0.5


@torch.inference_mode()
def measure_costs(dec, ids: torch.Tensor, iters: int = 16) -> DraftCosts:
    """The pair's `DraftCosts` on this device, timed with the decoder's own caches (p = target,
    q = drafter): medians over blocks of steps, the models interleaved so load drifts hit both
    alike. ids: (B, P), one prompt repeated; B > 1 is timed on the masked, batched path."""
    import statistics
    import time

    k = dec.max_draft
    b, plen = ids.shape
    width = max(dec.verify_widths[-1], k + 1)
    runners = [dec._runner(m, plen + width + 2) for m in (dec.target, dec.drafter)]
    # Batched decodes run masked steps with explicit positions (rows have holes), which cost
    # more than dense ones on CPU: time the path the decoder will take at this batch size.
    dense = b == 1
    mask = torch.ones(b, max(r.capacity for r in runners), dtype=torch.bool, device=dec.device)

    def step(runner, x: torch.Tensor, keep: int, prefill: bool = False) -> None:
        if dense:
            runner.forward(x, keep=keep, prefill=prefill)
            return
        n = x.shape[1]
        attn = mask[:, :n] if prefill else dec._attn(runner, mask, runner.length + n)
        pos = (runner.length + torch.arange(n, device=dec.device)).expand(b, n)
        runner.forward(x, attn, pos, keep=keep, prefill=prefill)

    for r in runners:
        if plen > 1:
            step(r, ids[:, :-1], 1, prefill=True)
    cuda = dec.device.type == "cuda"

    def timed(runner, w: int, reps: int = 4) -> float:
        base, x = runner.length, ids[:, -1:].repeat(1, w)
        if cuda:
            torch.cuda.synchronize(dec.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            step(runner, x, 1 if w == 1 else w)
            if w > 1:
                runner.rollback(base)
        if cuda:
            torch.cuda.synchronize(dec.device)
        runner.rollback(base)
        return (time.perf_counter() - t0) / reps

    # ratios per sample (each against the target step timed beside it), then medians: robust
    # to load that drifts between samples on a shared machine
    ratios: dict[str, list[float]] = {"d": [], "dk": [], "v1": [], "vk": []}
    for i in range(iters + 1):  # the first round is warm-up
        tt = timed(runners[0], 1)
        got = {
            # parallel: one drafter forward of 2 tokens (an accepted draft and the pending
            # token) proposes 1 draft, each further proposal adds a mask (timed at k masks)
            "d": timed(runners[1], 2 if dec.parallel else 1),
            "dk": timed(runners[1], k + 1) if dec.parallel else 0.0,
            "v1": timed(runners[0], 2),
            "vk": timed(runners[0], k + 1),
        }
        tt = (tt + timed(runners[0], 1)) / 2
        if i:
            for key, v in got.items():
                ratios[key].append(v / tt)
    med = {key: statistics.median(v) for key, v in ratios.items()}
    v1, vk = med["v1"], med["vk"]
    per_token = max(0.0, (vk - v1) / (k - 1)) if k > 1 else 0.0
    costs = DraftCosts(
        c=round(med["d"], 4),
        verify_per_token=round(per_token, 4),
        round_overhead=round(max(MIN_OVERHEAD, v1 - 1.0 - per_token) + ROUND_GLUE, 4),
        parallel=dec.parallel,
        draft_per_token=round(max(0.0, (med["dk"] - med["d"]) / (k - 1)), 4)
        if dec.parallel and k > 1
        else 0.0,
    )
    if not dense:  # a batched round's host-side glue grows with the batch: time real rounds
        glue = realized_overhead(dec, ids, costs)
        if glue > costs.round_overhead:
            costs = dataclasses.replace(costs, round_overhead=round(glue, 4))
    return costs


def realized_overhead(dec, ids: torch.Tensor, costs: DraftCosts, k: int = 2, tokens: int = 32):
    """A speculative round's overhead beyond its forwards, from whole decodes: fixed-gamma k
    rounds against target-only steps on `ids` (B rows), each decoded twice (the first warms),
    interleaved. Forward timings alone miss the per-row bookkeeping of batched rounds, which on
    CPU made adaptive lengths at batch 4 draft as if rounds were cheap."""
    import statistics
    import time

    cfg = dataclasses.replace(
        dec.cfg, draft_length="fixed", gamma=k, max_new_tokens=tokens, eos_token_id=()
    )
    fixed = type(dec)(dec.target, dec.drafter, cfg, tokenizer_len=dec.vocab)
    ratios = []
    for i in range(6):
        t0 = time.perf_counter()
        base = fixed.baseline(ids)
        t1 = time.perf_counter()
        spec = fixed.generate(ids)
        t2 = time.perf_counter()
        if i:
            step = (t1 - t0) / max(base.target_forwards, 1)
            ratios.append((t2 - t1) / max(spec.target_forwards, 1) / step)
    forwards = costs.round_cost(k) - costs.round_overhead  # drafts + verify, no glue
    return max(0.0, statistics.median(ratios) - forwards)


def draft_length_settings(dcfg) -> dict:
    """The `decoder` config node's draft-length keys as DecoderConfig keyword arguments
    (`draft_costs: auto` -> None: measured on the pair; or {c, verify_per_token, round_overhead,
    draft_per_token (parallel drafting)})."""
    from specdistill.data.runtime import ConfigError

    raw = dcfg.get("draft_costs", "auto")
    costs = None
    if raw not in (None, "auto"):
        try:
            costs = DraftCosts(**{k: float(v) for k, v in dict(raw).items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"decoder.draft_costs={raw!r}: auto, or a mapping of c, verify_per_token, "
                "draft_per_token, "
                f"round_overhead ({e})"
            ) from None
    return {
        "draft_length": str(dcfg.get("draft_length", "fixed")),
        "max_draft": dcfg.get("max_draft", 8),
        "draft_scope": str(dcfg.get("draft_scope", "batch")),
        "draft_floor": dcfg.get("draft_floor", True),
        "probe_every": dcfg.get("probe_every", 8),
        "draft_costs": costs,
    }


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
    if costs is not None:
        figures["draft_costs"] = {
            "c": costs.c,
            "verify_per_token": costs.verify_per_token,
            "round_overhead": costs.round_overhead,
        }
        if costs.parallel:
            figures["draft_costs"]["draft_per_token"] = costs.draft_per_token
    return figures
