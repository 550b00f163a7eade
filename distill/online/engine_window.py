"""Figures of a served run, from the engine's own counters: one row per window of requests.

Every figure comes from llama-server's per-request counters (decode/llamacpp/measure.py):
acceptance = accepted / drafted tokens, tau = decode tokens per target round, tokens/s over
the decode part. The frozen starting drafter answers the same requests with the same seeds
(its own server), and the target alone answers them once more for greedy identity and the
plain speed. The keys `alpha_adapted` / `alpha_frozen` hold the engine's acceptance so that the
stage's segment summary, plot and drift gate read served runs as they read ours.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdistill.decode.llamacpp.measure import acceptance, tau, tokens_per_second
from specdistill.distill.online.served import completion_from, completion_record

ROLES = ("adapted", "frozen", "plain")


def _rounded(value: float, digits: int, present: bool) -> float | None:
    return round(value, digits) if present else None


@dataclass
class EngineWindow:
    """The window being served: its answers by role, and what updates and swaps cost."""

    first_request: int
    answers: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {role: [] for role in ROLES}
    )
    segments: list[int] = field(default_factory=list)
    updates: int = 0
    rollbacks: int = 0
    swaps: int = 0
    swap_seconds: list[float] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)
    update_seconds: float = 0.0
    restarts: int = 0
    losses: list[float] = field(default_factory=list)

    def add(self, answers: dict[str, Any], segment: int, restarts: int) -> None:
        """One request's answers (`Completion`s by role)."""
        for role, c in answers.items():
            self.answers[role].append(completion_record(c))
        self.segments.append(segment)
        self.restarts += restarts

    def row(self, requests: int, greedy: bool) -> dict[str, Any]:
        """The window's figures; `requests`: requests served so far."""
        got = {r: [completion_from(x) for x in self.answers[r]] for r in ROLES}
        figures: dict[str, Any] = {"requests": requests, "first_request": self.first_request,
                                   "segments": sorted(set(self.segments))}  # fmt: skip
        for role in ("adapted", "frozen"):
            cs = got[role]
            figures[f"alpha_{role}"] = _rounded(acceptance(cs), 4, bool(cs))
            figures[f"tau_{role}"] = _rounded(tau(cs), 3, bool(cs))
            figures[f"drafted_{role}"] = sum(c.draft_n for c in cs)
            figures[f"accepted_{role}"] = sum(c.draft_n_accepted for c in cs)
        for role in ROLES:
            cs = got[role]
            figures[f"tokens_per_s_{role}"] = _rounded(tokens_per_second(cs), 1, bool(cs))
        figures["identical"] = identical(got, greedy)
        figures |= {
            "updates": self.updates, "rollbacks": self.rollbacks, "swaps": self.swaps,
            "swap_seconds_max": round(max(self.swap_seconds), 3) if self.swap_seconds else None,
            "gguf_write_seconds": (round(statistics.median(self.write_seconds), 3)
                                   if self.write_seconds else None),
            "update_seconds": round(self.update_seconds, 2),
            "restarts": self.restarts,
            "loss": round(sum(self.losses) / len(self.losses), 4) if self.losses else None,
        }  # fmt: skip
        return figures

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EngineWindow:
        return cls(**state)


def identical(got: dict[str, list], greedy: bool) -> bool | None:
    """Greedy: every speculative answer equals the target alone's; None when there is nothing
    to compare (sampled serving, or no plain server)."""
    plain = got["plain"]
    if not greedy or not plain:
        return None
    return all(
        c.tokens == p.tokens for role in ("adapted", "frozen") for c, p in zip(got[role], plain)
    )


def markdown(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """online.md of a served run: the by-window table and what swaps, restarts and resumes
    cost."""
    fmt = lambda v: "-" if v is None else f"{v}"  # noqa: E731
    lines = [
        f"# Online adaptation in {result['engine']}: {Path(result['drafter_start']).name} -> "
        f"{result['drafter_path']}",
        "",
        f"{result['requests']} requests served by {result['version']}, K={result['k']}, "
        f"{result['decoder']}; figures from the engine's own counters (acceptance = accepted / "
        "drafted tokens).",
        "",
        "| requests | segments | acceptance frozen / adapted | tau frozen / adapted | "
        "tokens/s plain / frozen / adapted | greedy = plain | updates (rolled back) | "
        "swap s (max) | restarts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['first_request'] + 1}-{r['requests']} | "
            f"{','.join(str(s) for s in r['segments'])} | {fmt(r['alpha_frozen'])} / "
            f"{fmt(r['alpha_adapted'])} | {fmt(r['tau_frozen'])} / {fmt(r['tau_adapted'])} | "
            f"{fmt(r['tokens_per_s_plain'])} / {fmt(r['tokens_per_s_frozen'])} / "
            f"{fmt(r['tokens_per_s_adapted'])} | {fmt(r['identical'])} | {r['updates']} "
            f"({r['rollbacks']}) | {fmt(r['swap_seconds_max'])} | {r['restarts']} |"
        )
    lines += [
        "",
        f"- swaps {result['swaps']}: the new server ready in {fmt(result['swap_seconds_max'])} s "
        f"at most (median {fmt(result['swap_seconds_median'])} s), the GGUF written in "
        f"{fmt(result['gguf_write_seconds_median'])} s (median; learner time, between requests)",
        f"- server restarts {result['restarts']}; requests replayed from the journal on resume "
        f"{result['replayed']}; the resumed server's drafter identical to the one served "
        f"before: {fmt(result['resumed_same_drafter'])}",
        f"- greedy output identical to the target alone in every window: "
        f"{fmt(result['identical'])}",
        "",
    ]
    return "\n".join(lines)
