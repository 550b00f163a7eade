"""Prompt lookup: drafts copied from the context's own n-grams, at no drafter cost.

p = target, q = drafter. Long prompts repeat themselves: where the last n tokens (n from
`MAX_NGRAM` down to `min_ngram`) occurred before, the tokens that followed them are a draft that
costs no drafter forward (Saxena's prompt lookup decoding; vLLM's `ngram`). The round loop takes
such a draft before asking the drafter; rounds without a match run as before.

Lossless: the drafts come from tokens already emitted, never from p of the round; q is one-hot,
so sampling accepts x with probability p(x) and resamples from p with x removed. Opt-in, since
engines serve it as a drafter of its own: a decode's report counts its rounds apart.
"""

from __future__ import annotations

MAX_NGRAM = 4  # longest suffix matched; longer matches add little over 4 tokens of code or text


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
    and its n-gram index."""

    def __init__(self, prompt: list[int], min_ngram: int = 2) -> None:
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
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

    def propose(self, budget: int) -> list[int]:
        """This round's lookup drafts (at most `budget`), or [] to let the drafter take it."""
        return find_continuation(self.history, self.index, self.min_ngram, budget)
