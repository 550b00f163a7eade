"""What the served loop (distill/online/in_engine.py) asks of an engine, and what it keeps of
each answer.

The loop is the same whichever engine serves: each request is asked of the roles `adapted`
(the target with the drafter being adapted), `frozen` (with the starting drafter) and `plain`
(the target alone), one after another with one seed; an update's weights are offered to the
engine as the `candidate` role, which a guarded update asks the probe of, then promoted to
`adapted` or dropped. An engine keeps what it needs to serve those roles (servers, files,
weights) to itself, so llama.cpp's blue-green processes and vLLM's in-place reloads sit behind
the same five calls.

An answer is kept as the engine's counters for that one request: drafted and accepted tokens
and the target's verification rounds after the first token (which the prompt's forward
samples), so tokens - 1 = rounds + accepted, and tau = (tokens - 1) / rounds, the definition of
our decoder's `DecodeOutput.tau` and of decode/llamacpp/measure.py. Figures pool answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from specdistill.data.sampling import Sampling

ROLES = ("adapted", "frozen", "plain")


@dataclass(frozen=True)
class Answer:
    """One request's answer by one role, with the engine's counters for it."""

    tokens: list[int]
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens the target accepted
    rounds: int  # target verification rounds after the first token
    decode_ms: float  # from the first token to the last
    prompt_ms: float  # the prompt's forward (and queueing), up to the first token

    def record(self) -> dict[str, Any]:
        """The answer as the journal and the checkpoint keep it (JSON)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Answer:
        return cls(**record)


def decode_tokens(a: Answer) -> int:
    """Tokens emitted by rounds: all but the first, which the prompt's forward samples."""
    return max(len(a.tokens) - 1, 0)


def acceptance(answers: Sequence[Answer]) -> float:
    """Accepted over drafted tokens, pooled over requests (0.0 when nothing was drafted)."""
    drafted = sum(a.drafted for a in answers)
    return sum(a.accepted for a in answers) / drafted if drafted else 0.0


def tau(answers: Sequence[Answer]) -> float:
    """Decode tokens per target round, pooled (0.0 without rounds)."""
    n = sum(a.rounds for a in answers)
    return sum(decode_tokens(a) for a in answers) / n if n else 0.0


def tokens_per_second(answers: Sequence[Answer]) -> float:
    """Decode tokens over decode seconds, pooled: the first token is timed with the prompt."""
    ms = sum(a.decode_ms for a in answers)
    return 1000.0 * sum(decode_tokens(a) for a in answers) / ms if ms > 0 else 0.0


class ServedEngine(Protocol):
    """An engine serving the stage's roles. `drafter` is the torch drafter being adapted (its
    current weights are what `start` and `offer` put in service)."""

    name: str  # the `engine` value: llamacpp, vllm

    def start(self, drafter: Any, roles: Sequence[str], resumed: bool) -> bool | None:
        """Serve `roles`, `adapted` on `drafter`'s weights, `frozen` on the starting drafter's.
        When `resumed`, whether the adapted drafter is the one served before the stage stopped
        (compared exactly); else None."""
        ...

    def answer(self, role: str, ids: list[int], n: int, sampling: Sampling,
               seed: int) -> tuple[Answer, int]:  # fmt: skip
        """(`role`'s answer to the prompt `ids`, engine restarts it took)."""
        ...

    def offer(self, drafter: Any) -> tuple[float, float]:
        """Put `drafter`'s weights in service as the `candidate` role: (seconds preparing them
        in the learner, seconds until the engine serves them: what the swap costs serving)."""
        ...

    def settle(self, promoted: bool) -> None:
        """The candidate becomes `adapted` (promoted), or is dropped and `adapted` serves on."""
        ...

    def stop(self) -> None:
        """Stop serving (idempotent); `start` serves again."""
        ...

    def version(self) -> str:
        """The engine's release, for the report."""
        ...
