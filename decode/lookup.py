"""Prompt lookup: drafts copied from the context's own n-grams, at no drafter cost.

p = target, q = drafter, k = drafts per round. Long prompts (a whole file, retrieved documents, a
tool's output) repeat themselves: identifiers, calls, whole lines come back. Where the last n
tokens (n from `MAX_NGRAM` down to `min_ngram`) occurred before, the tokens that followed them
then are a draft that costs no drafter forward at all, only the verify's extra positions; the
longer the context, the more often one exists (Saxena's prompt lookup decoding; vLLM's `ngram`
method). `decoder.lookup=true` lets the round loop take such a draft before asking the drafter
(`SpeculativeDecoder._round`); rounds without a match run as before.

Lossless either way: the drafts are read from tokens already emitted (the prompt and the target's
own output), never from p of the round being drafted. They are deterministic proposals, q a one-hot
row: greedy keeps the matching prefix; speculative sampling accepts draft x with probability
min(1, p(x) / 1) = p(x) and resamples from p with x removed, exactly the target's distribution.

How many drafts to verify: the verify's extra positions cost `verify_per_token` target steps each
(at long contexts on CPU, attention makes each dearer); `best_length` picks the count that
maximizes expected tokens per cost from the running acceptance of earlier lookup drafts.
"""

from __future__ import annotations

from specdistill.decode.draft_length.costs import DraftCosts, expected_tokens

MAX_NGRAM = 4  # longest suffix matched; longer matches add little over 4 tokens of code or text
PRIOR = 0.5  # acceptance assumed before any lookup draft was verified
EMA = 0.2  # weight of the newest lookup draft's outcome in the running acceptance
RETRY_EVERY = 8  # a match the running acceptance turns down is still tried once in this many


def best_length(accept: float, available: int, costs: DraftCosts) -> tuple[int, float]:
    """(drafts, rate): how many of `available` lookup drafts to verify when each is accepted with
    probability `accept` given the ones before were (rate: expected tokens per target-step cost;
    no drafter forward), if any count's rate beats a plain target step's 1; (0, 1.0) when none
    does."""
    best, rate = 0, 1.0
    for j in range(1, available + 1):
        r = expected_tokens([accept] * j) / costs.verify_cost(j)
        if r > rate + 1e-12:
            best, rate = j, r
    return best, rate


def find_continuation(
    history: list[int], index: list[dict[tuple[int, ...], int]], min_ngram: int, k: int
) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of history's longest suffix
    n-gram (n = MAX_NGRAM .. min_ngram) with an occurrence; [] when none. `index[n]` maps each
    n-gram of history to the position after its latest occurrence that has a continuation."""
    for n in range(MAX_NGRAM, min_ngram - 1, -1):
        if len(history) < n:
            continue
        start = index[n].get(tuple(history[-n:]))
        if start is not None:
            return history[start : start + k]
    return []


class PromptLookup:
    """One batch-1 decode's lookup state: the token history (prompt, then every emitted token),
    its n-gram index, and the running acceptance of the lookup drafts verified so far."""

    def __init__(self, prompt: list[int], min_ngram: int = 2) -> None:
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.accept = PRIOR
        self.declined = 0  # matches turned down since the last lookup round
        self.extend(prompt)
        self.prompt_len = len(prompt)

    def catch_up(self, emitted: list[int]) -> None:
        """Index the tokens the decode emitted since the last call (`emitted`: all of them, as
        the decode's output row holds them): the history is the prompt followed by that row."""
        self.extend(emitted[len(self.history) - self.prompt_len :])

    def extend(self, tokens: list[int]) -> None:
        """Append emitted tokens, indexing each n-gram that now has a continuation."""
        h, index = self.history, self.index
        for tok in tokens:
            i = len(h)  # the new token's position: it continues the n-grams ending at i - 1
            for n in range(self.min_ngram, MAX_NGRAM + 1):
                if i >= n:
                    index[n][tuple(h[i - n : i])] = i
            h.append(tok)

    def propose(self, budget: int, costs: DraftCosts) -> list[int]:
        """This round's lookup drafts (at most `budget`), or [] to let the drafter (or the floor)
        take the round: no match, or one whose expected rate at the running acceptance does not
        beat a plain step (still tried once in RETRY_EVERY, so a good spell later is noticed).
        Not priced against the drafter's best round: that turned down lookup rounds that paid
        (decode/RESULTS.md)."""
        found = find_continuation(self.history, self.index, self.min_ngram, budget)
        if not found:
            return []
        j, _ = best_length(self.accept, len(found), costs)
        if j == 0:
            self.declined += 1
            if self.declined < RETRY_EVERY:
                return []
            j = 1
        self.declined = 0
        return found[:j]

    def observe(self, drafted: int, accepted: int) -> None:
        """A lookup round verified `drafted` drafts and kept `accepted`: each draft up to the
        first reject is one acceptance trial (the rest were never tested). The decode's counts
        live in its `DecodeOutput` (`lookup_*`)."""
        for j in range(min(accepted + 1, drafted)):
            self.accept += EMA * (float(j < accepted) - self.accept)
