"""The draft-length policies: per round, how many drafts q proposes before the target p verifies.

p = target, q = drafter. A fixed gamma pays gamma drafter steps every round however poor the
drafts; these policies choose the length round by round from what the decoder already knows,
and fall back to plain target steps (a round with 0 drafts) when drafting does not pay.

Lossless by construction: a policy reads the drafter's own distributions q and the outcomes of
*earlier* rounds, never the target's p of the round being drafted, so the acceptance rule stays
exact for whatever length it picks (a length is just a stopping time of the draft; tests check
greedy identity and the sampled distribution with a chi-square test). When sampling, an earlier
round's tested draft x counts as its acceptance probability min(1, p(x)/q(x)) rather than the
0/1 outcome of its coin: the same expectation given x, less noise, so a few unlucky coins do not
switch a drafter that pays off (`verdicts`). The floor's averages, which ask how often a draft is
accepted whatever it drafts, take the position's expected acceptance sum_x min(p, q) instead:
the same expectation again, averaged over x as well (the calibrations keep min(1, p(x)/q(x)):
they predict from q(x), the drafted token's own probability).

The cost model and the expected-gain rule the policies plan with are pure functions of
`costs.py` (p = target, q = drafter, c = drafter step / target step, gamma = drafts per round).

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
64 probe_every, carried from call to call), one that does resets it to `probe_every`; a losing
probe after which even the most hopeful acceptance the lifetime's verdicts allow (a Hoeffding
bound at 1 - `doubt`) does not pay sets the longest interval at once (`_could_pay`). A drafter
that reads the prompt lazily (the floor's decodes) pays its prefill at the decode's first
drafting round: until then (`pending`, in target steps) a round drafts only where the gain the
rule expects over the tokens the decode has left (`left`) covers that prefill (`_prefill_pays`;
a probe on the most hopeful acceptances, a decision on the averages), so a short decode does
not buy the drafter's whole prefill for a round or two at break-even.

Batches (`draft_scope`): `batch` picks one length for all rows from their summed gains (a batched
drafter step costs the same however many rows use it); `row` lets each row stop on its own
(the batch drafts while any row goes on, each row verifies only its own drafts).

Parallel drafting (one drafter forward proposes all gamma tokens) fits the same functions: the
drafter cost no longer grows with k (`DraftCosts.parallel`), `verify_lengths` picks how many of
the proposals to verify from their known confidences, and the floor and the forward's proposal
count read one moving average per draft depth (`later`) instead of `follow`: a mask's
acceptance falls with its depth, where an autoregressive drafter's later drafts keep theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdistill.decode.draft_length.calibration import Calibration
from specdistill.decode.draft_length.costs import DraftCosts, best_more

POLICIES = ("fixed", "heuristic", "confidence")
SCOPES = ("batch", "row")


def verdicts(accepted: int, length: int, probs: list[float] | None) -> list[float]:
    """What a row's round taught about each draft put to the test (the first `accepted` + 1 of
    its `length`): 1 / 0 for accepted / rejected, or with `probs` (sampling) each draft x's
    acceptance probability min(1, p(x)/q(x)), the expectation of that 0/1 given x. A draft is
    tested only when the ones before it were accepted, which the coins before it decided, not
    its own: so the probability stays unbiased for it, without its coin's noise."""
    tested = min(accepted + 1, length)
    if probs is not None:
        return [float(v) for v in probs[:tested]]
    return [1.0 if j < accepted else 0.0 for j in range(tested)]


def _paying_m(gains: list[float]) -> int:
    """The m (1-based) of the largest of `gains` (per m = 1..len, `_gains`), or 0 when none is
    positive: a plain target step does as well."""
    best = max(range(len(gains)), key=gains.__getitem__, default=-1)
    return best + 1 if best >= 0 and gains[best] > 1e-12 else 0


@dataclass
class RoundPlan:
    """What a round drafts: at most `k` tokens (0: a plain target step); `probe` marks a floor
    probe."""

    k: int
    probe: bool = False


def _block_ema(avg: float, values: list[float], weight: float) -> float:
    """An exponential average moved by a block of values at once: the block keeps the weight
    len(values) one-at-a-time updates would give it, 1 - (1 - weight)^n, spread evenly over its
    values (their order inside the block is noise, not recency)."""
    keep = (1.0 - weight) ** len(values)
    return keep * avg + (1.0 - keep) * sum(values) / len(values)


class DraftLengthPolicy:
    """Base: a fixed gamma. Subclasses choose k per round; the decoder calls, per generate:
    `start(B)`, then per round `plan(budget, active)`, `keep_drafting(j, conf)` after each draft
    (only when `reads_q`), `lengths(k)`, then `observe(...)` after a verify or `observe_step`
    after a plain target step. Plain Python on a few floats per row: these run every drafter
    step, where tensor ops on tiny tensors would cost a sizeable share of a step.

    What the floor knows (per row, from earlier rounds only): `first` and `follow`, moving
    averages of the acceptance of a round's first draft and of the drafts after it (parallel
    drafting: `later`, one per depth 2..max_k), and the realized throughput (tokens per modeled
    cost, at least 1; prompt lookup's rounds included, `observe_lookup`).
    """

    reads_q = False
    # a floor's probe interval grows to at most this many probe_every: a probe costs the drafter's
    # prefill of the prompt (once per decode: it reads the prompt lazily) and its catch-up over
    # the skipped tokens, several target steps, which short decodes cannot amortise if a drafter
    # that never pays keeps probing every few dozen tokens (decode/RESULTS.md); a drafter that
    # pays resets the interval at its first probe, so a long ladder costs it nothing
    max_backoff = 64
    # the chance that a losing probe's Hoeffding bound writes off a drafter that pays: when even
    # the most hopeful acceptance the lifetime's verdicts allow at this level does not pay, the
    # interval jumps to its longest at once instead of climbing the ladder (`_could_pay`)
    doubt = 0.01
    # a call's realized throughput starts from the lifetime's as if this many target steps had
    # gone at it (`start`): a few rounds' weight, so the call's own rounds soon dominate
    rate_prior_steps = 8.0
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
        # set by the decoder: target steps the drafter's prefill would cost at this decode's first
        # drafting round (0 once it has read the prompt, or when it reads it eagerly), and the
        # most tokens the decode still emits
        self.pending, self.left = 0.0, 0
        # consecutive plain target steps, carried from call to call: with a backed-off interval
        # longer than one decode, a per-call count would never reach a probe again
        self.skipped = 0
        # lifetime counts (accepted, tested): the next call's starting averages
        self._life = {"first": [0.0, 0.0], "follow": [0.0, 0.0], "all": [0.0, 0.0]}
        # parallel drafting: lifetime counts per depth 2..max_k (index 0 is depth 2)
        self._life_depth = [[0.0, 0.0] for _ in range(max(max_k - 1, 0))]
        # realized tokens and modeled cost of the lifetime's finished calls (`start`)
        self._life_rate = [0.0, 0.0]
        self.tokens: list[float] = []
        self.cost: list[float] = []
        self._rate_prior = (0.0, 0.0)  # what `start` put in each row's tokens and cost

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

    def _depth_priors(self) -> list[float]:
        """Starting averages of depths 2..max_k (parallel drafting): each depth's lifetime
        counts shrunk towards the depth before's prior, so a depth never tested starts where
        the one before it stands (0.5 is far too hopeful for a deep mask)."""
        out, before = [], self._prior("first")
        for hits, seen in self._life_depth:
            before = (hits + 2 * before) / (seen + 2)
            out.append(before)
        return out

    # -- per generate call
    def start(self, batch: int) -> None:
        self.b = batch
        self.first = [self._prior("first")] * batch
        self.follow = [self._prior("follow")] * batch
        # parallel drafting: per row, depth d's acceptance given depths < d were accepted
        # (d = 2..max_k). A parallel drafter's masks lose far more per depth than an
        # autoregressive drafter's later drafts (SmolLM2: given the drafts before were kept,
        # depth 3 is kept a fraction as often as depth 2), so one `follow` pooled over depths
        # misprices every round length but the one the pool's tests came from
        depths = self._depth_priors()
        self.later = [list(depths) for _ in range(batch)]
        self.recent = [self._prior("all")] * batch
        # realized tokens and modeled cost: a call starts as if `rate_prior_steps` target steps
        # had gone at the lifetime's throughput (one step at 1 before any), so a decode's early
        # rounds, probes included, are priced at what the decoder achieves, not at 1: where
        # prompt lookup takes most rounds at several tokens each, a probe that beats only a
        # plain step loses time that lookup's rounds would have turned into more tokens
        prior_t, prior_c = self._rate_prior
        for t, c in zip(self.tokens, self.cost):
            self._life_rate[0] += t - prior_t
            self._life_rate[1] += c - prior_c
        life_t, life_c = self._life_rate
        if life_c > 0:
            steps = self.rate_prior_steps
            self._rate_prior = (steps * max(1.0, life_t / life_c), steps)
        else:
            self._rate_prior = (1.0, 1.0)
        self.tokens = [self._rate_prior[0]] * batch
        self.cost = [self._rate_prior[1]] * batch
        self.probing = False  # `interval` and `skipped` carry over from the last call
        self.shadowed = False  # this round's policy saw verdicts of skipped steps
        self.row_k: list[int] | None = None
        # ... unless this call's starting averages (the lifetime's) say drafting pays: a hold
        # carried over is the last prompt's verdict, and a new prompt should not serve out the
        # rest of a weak one's interval (a drafter that never pays keeps its hold and backoff)
        if self.floor and self.skipped and self._pays([True] * batch):
            self.skipped = 0

    def rate(self, r: int) -> float:
        """Throughput to beat for row r: realized tokens per modeled cost so far, at least 1."""
        return max(1.0, self.tokens[r] / self.cost[r])

    def _walk(self, first: float, follow: float, later: list[float]) -> list[float]:
        """Expected accepted drafts of a round of m = 1..max_k drafts: the first draft accepted
        at `first`, each later one, given the ones before were, at `follow` (autoregressive)
        or at its depth's `later` (parallel)."""
        out, reach, tokens = [], 1.0, 0.0
        for m in range(1, self.max_k + 1):
            reach *= first if m == 1 else later[m - 2] if self.costs.parallel else follow
            tokens += reach
            out.append(tokens)
        return out

    def _accepted_by_length(self, r: int) -> list[float]:
        """Row r's `_walk` at its recent acceptance."""
        return self._walk(self.first[r], self.follow[r], self.later[r])

    def _walks(self, active: list[bool]) -> list[list[float]]:
        return [self._accepted_by_length(r) if active[r] else [] for r in range(self.b)]

    def _gains(self, active: list[bool], walks: list[list[float]]) -> list[float]:
        """Per m = 1..max_k: the active rows' summed net gain of a round of m drafts over a
        plain target step (tokens - rate * extra cost, `costs.py`)."""
        inc = self.increments[0]
        total = [0.0] * len(inc)
        for r in range(self.b):
            if active[r]:
                rate = self.rate(r)
                for i, (tokens, c) in enumerate(zip(walks[r], inc)):
                    total[i] += tokens - rate * c
        return total

    def _best_m(self, active: list[bool], walks: list[list[float]] | None = None) -> int:
        """The number of drafts m >= 0 that pays best at the rows' recent acceptance, or on
        the given per-row `walks` (0: a target step beats every m). Batch scope: gains summed
        over the active rows; row scope: the most any active row wants."""
        inc = self.increments[0]
        if walks is None:
            walks = self._walks(active)
        if self.scope == "row":
            return max(
                (self._row_best_m(r, inc, walks[r]) for r in range(self.b) if active[r]),
                default=0,
            )
        return _paying_m(self._gains(active, walks))

    def _prefill_pays(self, active: list[bool], hopeful: bool = False) -> bool:
        """Does drafting from this round on repay the drafter's pending prefill? The best m's
        summed gain a round (tokens over a plain step's) times the rounds the decode has left
        (`left` tokens at 1 + its expected accepted drafts a round) against the prefill's
        `pending` target steps at the rows' throughput. hopeful: on the most hopeful acceptances
        the lifetime's verdicts allow (what a probe explores with), else the averages."""
        if self.pending <= 0:
            return True
        walks = [self._hopeful_walk()] * self.b if hopeful else self._walks(active)
        gains = self._gains(active, walks)
        best = _paying_m(gains) - 1
        if best < 0:
            return False
        rows = [r for r in range(self.b) if active[r]]
        per_round = sum(1.0 + walks[r][best] for r in rows) / len(rows)
        rate = sum(self.rate(r) for r in rows) / len(rows)
        return gains[best] * self.left / per_round > rate * self.pending

    def _row_best_m(self, r: int, inc: list[float], walk: list[float]) -> int:
        """Row r's best number of drafts m >= 0 on its walk of acceptances (`best_more`'s
        argmax, with a parallel drafter's per-depth averages in the walk)."""
        rate, best, best_g = self.rate(r), 0, 0.0
        for m, (tokens, c) in enumerate(zip(walk, inc), 1):
            if tokens - rate * c > best_g + 1e-12:
                best, best_g = m, tokens - rate * c
        return best

    def _pays(self, active: list[bool]) -> bool:
        """Does drafting (some m >= 1 drafts at the rows' recent acceptance) beat a target step?"""
        return self._best_m(active) > 0

    def _hopeful(self, counts: list[float], fallback: float) -> float:
        """The most hopeful acceptance lifetime verdicts (counts: their sum and number, each
        in [0, 1]) allow at confidence 1 - doubt: their mean plus Hoeffding's
        sqrt(ln(1 / doubt) / 2n), at most 1; `fallback` when there are none."""
        hits, seen = counts
        if seen <= 0:
            return fallback
        return min(1.0, hits / seen + math.sqrt(math.log(1.0 / self.doubt) / (2.0 * seen)))

    def _could_pay(self, active: list[bool]) -> bool:
        """Would drafting pay at the most hopeful acceptances the lifetime's verdicts allow
        (`_hopeful`)? No means the evidence already rules drafting out, and more probes would
        buy little. A later draft with no verdicts of its own (sampled rounds that stop after
        one draft test none) is taken to be as good as the first: at a temperature a draft's
        acceptance hardly depends on whether the one before was kept. Each parallel depth falls
        back on the one before. doubt 0: nothing is ever ruled out (the plain ladder)."""
        if self.doubt <= 0:
            return True
        return self._best_m(active, [self._hopeful_walk()] * self.b) > 0

    def _hopeful_walk(self) -> list[float]:
        """`_walk` at the most hopeful acceptances the lifetime's verdicts allow (`_hopeful`)."""
        first = self._hopeful(self._life["first"], 1.0)
        follow = self._hopeful(self._life["follow"], first)
        later, before = [], first
        for counts in self._life_depth:
            before = self._hopeful(counts, before)
            later.append(before)
        return self._walk(first, follow, later)

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
            if not self._prefill_pays(active, hopeful=True):  # not in what this decode has left
                self.skipped = 1
                return RoundPlan(0)
            self.skipped, self.probing = 0, True
            return RoundPlan(self._k(budget), probe=True)
        if self._pays(active) and self._prefill_pays(active):
            return RoundPlan(self._k(budget))
        self.skipped = 1
        return RoundPlan(0)

    def _k(self, budget: int) -> int:
        return min(self.gamma, budget)

    def observe_step(self, active: list[bool]) -> None:
        """After a plain target step: one token for one target step per active row."""
        self._realized(active, 1.0, 1.0)

    def _realized(self, active: list[bool], tokens: float, cost: float) -> None:
        """A round without drafter forwards: `tokens` for `cost` target steps per active row."""
        for r, a in enumerate(active):
            if a:
                self.tokens[r] += tokens
                self.cost[r] += cost

    def observe_lookup(self, drafted: int, accepted: int, active: list[bool]) -> None:
        """After a prompt-lookup round (`decode.lookup`): its tokens for its modeled cost (a
        verify of `drafted` drafts, no drafter forward) join the realized throughput `rate`.
        That rate is what a drafting round must beat (Dinkelbach: each target step of time is
        worth the throughput the decode achieves), and lookup's rounds are part of it: where
        they take most rounds at several tokens each, a drafter round that beats only a plain
        step spends time worth more tokens than it brings."""
        self._realized(active, accepted + 1.0, self.costs.verify_cost(drafted))

    def observe_shadow(
        self, verdicts: list[list[float]], active: list[bool], pairs: bool, block: bool = False
    ) -> None:
        """The floor's plain steps tested no draft, but the drafter's next forward reads their
        tokens anyway: verdicts[r] (oldest first) estimates, per skipped token of row r, the
        acceptance its first draft would have had (`SpeculativeDecoder._observe_shadow`). Every
        verdict is a first draft's (a round may start at any skipped token); with pairs (greedy
        autoregressive drafting) a verdict after a hit is also the next draft's of a round that
        drafted on. So the floor switches drafting back on from what it skipped, not from one
        probe's luck. Reads only tokens already emitted: the acceptance rule stays exact.

        block (sampling: each verdict is min(1, q/p), a noisy estimate of one token): the block
        moves `first` and `follow` as far as one verdict at a time would (its total weight) but
        weighs its verdicts alike (`_block_ema`). Fed one by one, the average after 64 verdicts
        is set by the last ~10, and a drafter below break-even often looks as if it paid, each
        false start costing rounds that lose and probes back up the backoff ladder. Greedy verdicts are exact hits and misses that come in runs (a copied span, then
        none): there the newest say most about the next round, so they go one at a time."""
        for r, a in enumerate(active):
            row = verdicts[r]
            if not a or not row:
                continue
            after_hit = [ok for j, ok in enumerate(row) if pairs and j > 0 and row[j - 1] == 1.0]
            if block:
                self._learn_block(r, "first", row)
                self._learn_block(r, "follow", after_hit)
                for ok in row:  # the calibration's `recent` is recency itself: one at a time
                    self.recent[r] = (1 - self.ema) * self.recent[r] + self.ema * ok
                self._life["all"][0] += sum(row)
                self._life["all"][1] += len(row)
            else:
                for j, ok in enumerate(row):
                    self._learn(r, "first", ok)
                    if pairs and j > 0 and row[j - 1] == 1.0:
                        self._learn_block(r, "follow", [ok])
            self.shadowed = True

    def _learn(self, r: int, key: str, ok: float) -> None:
        """One tested draft of row r (ok: accepted or not) into the floor's `key` average
        ("first" / "follow"), the calibration's `recent`, and the lifetime counts the next call
        starts from."""
        fe, life = self.floor_ema, self._life
        avg = self.first if key == "first" else self.follow
        avg[r] = (1 - fe) * avg[r] + fe * ok
        life[key][0] += ok
        life[key][1] += 1
        self.recent[r] = (1 - self.ema) * self.recent[r] + self.ema * ok
        life["all"][0] += ok
        life["all"][1] += 1

    def _learn_depth(self, r: int, j: int, ok: float) -> None:
        """Parallel drafting: a tested draft at depth j + 1 >= 2 of row r into that depth's
        average and lifetime counts (`_learn` has counted it as a `follow` already)."""
        fe = self.floor_ema
        self.later[r][j - 1] = (1 - fe) * self.later[r][j - 1] + fe * ok
        self._life_depth[j - 1][0] += ok
        self._life_depth[j - 1][1] += 1

    def _learn_block(self, r: int, key: str, oks: list[float]) -> None:
        """A block of verdicts of row r into the floor's `key` average ("first" / "follow") and
        the lifetime counts, weighted alike (`_block_ema`); `recent` is the caller's."""
        if not oks:
            return
        avg = self.first if key == "first" else self.follow
        avg[r] = _block_ema(avg[r], oks, self.floor_ema)
        self._life[key][0] += sum(oks)
        self._life[key][1] += len(oks)

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
        probs: list[list[float]] | None = None,
        alphas: list[list[float]] | None = None,
    ) -> None:
        """After the verify: row r verified lengths[r] drafts and accepted accepted[r]; conf
        (B lists of K): the drafter's confidence per draft (confidence policy); probs (sampling,
        B lists of K): each draft's acceptance probability (`verdicts`); alphas (sampling, B
        lists of K): each position's expected acceptance sum_x min(p, q), what the floor's
        averages learn when given (probs otherwise)."""
        k = max(lengths) if lengths else 0
        cost = self.costs.round_cost(k)
        seen = probs if alphas is None else alphas
        for r, a in enumerate(active):
            if not a:
                continue
            n, kr = accepted[r], lengths[r]
            self.tokens[r] += n + 1
            self.cost[r] += cost
            for j, ok in enumerate(verdicts(n, kr, None if seen is None else seen[r])):
                self._learn(r, "first" if j == 0 else "follow", ok)
                if j and self.costs.parallel:
                    self._learn_depth(r, j, ok)
        if self.probing:  # did the probe pay for itself?
            self.probing = False
            # with the skipped steps' verdicts (`observe_shadow`) the probe is judged by the
            # rule on averages that now hold the whole interval's evidence; without them, by
            # one round's tokens against its cost in target steps. A probe costs the drafter's
            # catch-up over the skipped tokens on top of its round, so one that does not pay
            # backs off (a weak drafter then probes once per max_backoff * probe_every tokens)
            if self.shadowed:
                paid = self._pays(active)
            else:
                got = sum(n + 1 for n, a in zip(accepted, active) if a)
                paid = got >= cost * sum(active)
            longest = self.max_backoff * self.probe_every
            if paid:
                self.interval = self.probe_every
            elif self._could_pay(active):
                self.interval = min(2 * self.interval, longest)
            else:  # ruled out by the evidence, not one probe's luck: no ladder to climb
                self.interval = longest
        self.shadowed = False
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

    def observe(self, lengths, accepted, active, conf, probs=None, alphas=None) -> None:
        super().observe(lengths, accepted, active, conf, probs, alphas)
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

    def observe(self, lengths, accepted, active, conf, probs=None, alphas=None) -> None:
        if conf and self.costs.parallel:
            self._observe_depths(lengths, accepted, active, conf, probs)
            super().observe(lengths, accepted, active, None, probs, alphas)
            return
        if conf:
            cs, rs, oks, fc, fr, fok = [], [], [], [], [], []
            for r, a in enumerate(active):
                if not a:
                    continue
                row = verdicts(accepted[r], lengths[r], None if probs is None else probs[r])
                t = len(row)
                cs += conf[r][:t]
                rs += [self.r0[r]] * t
                oks += row
                # pairs (confidence of an accepted draft, was the next one accepted?)
                f = max(min(accepted[r], lengths[r] - 1), 0)
                fc += conf[r][:f]
                fr += [self.r0[r]] * f
                fok += row[1 : f + 1]
            self.accept.update(cs, rs, oks)
            # without evidence of its own, the next draft is predicted like this one
            self.follow_cal.set_prior(self.accept.w)
            self.follow_cal.update(fc, fr, fok)
        super().observe(lengths, accepted, active, conf, probs, alphas)

    def _observe_depths(self, lengths, accepted, active, conf, probs=None) -> None:
        """Each depth's calibration learns from the drafts put to the test at that depth (the
        ones whose predecessors were all accepted), with the depth before's fit as its prior."""
        per = [([], [], []) for _ in self.depth]
        for r, a in enumerate(active):
            if not a:
                continue
            for j, verdict in enumerate(
                verdicts(accepted[r], lengths[r], None if probs is None else probs[r])
            ):
                c, rs, ok = per[j]
                c.append(conf[r][j])
                rs.append(self.r0[r])
                ok.append(verdict)
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
