"""Figures from llama-server's per-request counters: acceptance, tau, tokens/s, speedup,
greedy identity. Pure: lists of `Completion`s in, an `EngineFigures` out.

Vocabulary as in the rest of `decode/`: the target p verifies, the drafter q proposes; tau =
tokens emitted per target verification round (bonus token included), acceptance = accepted
drafts / drafted tokens.

What the server reports (b11434, `server_slot_stats`): `predicted_n` (generated tokens, the
first included), `predicted_ms` (from the first token to the last), `draft_n` (drafted
tokens), `draft_n_accepted`. The first token is sampled from the prompt's own forward, before
any round (the server excludes it from `predicted_per_second` too), so a request's decode
part has `predicted_n - 1` tokens. Each round after it, with or without drafts, is one target
forward that emits its accepted drafts plus one token of p's, so

    predicted_n - 1 = rounds + accepted   =>   rounds = predicted_n - 1 - accepted,
    tau = (predicted_n - 1) / rounds,

the same definition as our decoder's `DecodeOutput.tau` (prefill excluded) and llama.cpp's
own logged "mean len" (1 + accepted / verification rounds) when every round drafts. Exact when
generation stops at `n_predict` (the server never drafts past the tokens left) or with
`ignore_eos`; a stop on EOS inside a round counts drafts accepted after the EOS that were never
emitted (at most K per request). The server logs its own round count (`n_draft_verif_steps`)
but leaves it out of the response's `timings`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdistill.decode.llamacpp.server import Completion


@dataclass
class EngineFigures:
    """One engine run's figures over a prompt set: plain vs speculative on the same prompts."""

    acceptance: float  # accepted / drafted over all requests
    tau: float  # decode tokens per target round (1..K+1)
    drafted: int
    accepted: int
    rounds: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float  # spec tokens/s over plain tokens/s
    greedy_identical: bool  # every request's tokens equal (meaningful at temperature 0)
    mismatched: list[int]  # indices of the requests whose tokens differ
    requests: int


def decode_tokens(c: Completion) -> int:
    """Tokens emitted by rounds: all but the first, which the prompt's forward samples."""
    return max(c.predicted_n - 1, 0)


def rounds(c: Completion) -> int:
    """Target verification rounds of one request: `predicted_n - 1 - draft_n_accepted`."""
    return max(decode_tokens(c) - c.draft_n_accepted, 0)


def acceptance(completions: Sequence[Completion]) -> float:
    """Accepted drafts over drafted tokens, pooled over requests (0.0 when nothing was drafted)."""
    drafted = sum(c.draft_n for c in completions)
    return sum(c.draft_n_accepted for c in completions) / drafted if drafted else 0.0


def tau(completions: Sequence[Completion]) -> float:
    """Decode tokens per target round, pooled: sum(predicted_n - 1) / sum(rounds)."""
    n = sum(rounds(c) for c in completions)
    return sum(decode_tokens(c) for c in completions) / n if n else 0.0


def tokens_per_second(completions: Sequence[Completion]) -> float:
    """Decode tokens over decode seconds, pooled (the server's `predicted_per_second` for one).

    The first token is left out of both, as the server does: it is timed with the prompt.
    """
    ms = sum(c.predicted_ms for c in completions)
    return 1000.0 * sum(decode_tokens(c) for c in completions) / ms if ms > 0 else 0.0


def speedup(plain: Sequence[Completion], spec: Sequence[Completion]) -> float:
    """Speculative tokens/s over plain tokens/s on the same prompts."""
    base = tokens_per_second(plain)
    return tokens_per_second(spec) / base if base > 0 else 0.0


def mismatches(plain: Sequence[Completion], spec: Sequence[Completion]) -> list[int]:
    """Indices of the prompts whose generated ids differ between the two runs."""
    if len(plain) != len(spec):
        raise ValueError(f"{len(plain)} plain completions against {len(spec)} speculative ones")
    return [i for i, (a, b) in enumerate(zip(plain, spec)) if a.tokens != b.tokens]


def engine_figures(plain: Sequence[Completion], spec: Sequence[Completion]) -> EngineFigures:
    """All figures at once; `plain` and `spec` are the same prompts in the same order."""
    bad = mismatches(plain, spec)
    return EngineFigures(
        acceptance=acceptance(spec),
        tau=tau(spec),
        drafted=sum(c.draft_n for c in spec),
        accepted=sum(c.draft_n_accepted for c in spec),
        rounds=sum(rounds(c) for c in spec),
        plain_tokens_per_s=tokens_per_second(plain),
        spec_tokens_per_s=tokens_per_second(spec),
        speedup=speedup(plain, spec),
        greedy_identical=not bad,
        mismatched=bad,
        requests=len(spec),
    )
