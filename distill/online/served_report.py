"""Figures of a served run, from the engine's own counters: one row per window of requests, and
its result.json, online.md and online.png.

Every figure comes from the engine's per-request counters (distill/online/engines/base.py):
acceptance = accepted / drafted tokens, tau = decode tokens per target round, tokens/s over
the decode part. The frozen starting drafter answers the same requests with the same seeds,
and the target alone answers them once more for greedy identity and the plain speed. The keys `alpha_adapted` / `alpha_frozen` hold the engine's acceptance so that the
stage's segment summary, plot and drift gate read served runs as they read ours.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.distill.online.engines.base import (
    ROLES,
    Answer,
    acceptance,
    tau,
    tokens_per_second,
)
from specdistill.distill.online.report import plot, segment_summary
from specdistill.distill.online.stream import boundaries

# what a swap's seconds measure, by engine
SWAP = {
    "llamacpp": "a second llama-server started on the new GGUF until /health answers",
    "vllm": "the weights loaded into the running engine in place",
}


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
        """One request's answers (`Answer`s by role)."""
        for role, a in answers.items():
            self.answers[role].append(a.record())
        self.segments.append(segment)
        self.restarts += restarts

    def row(self, requests: int, greedy: bool) -> dict[str, Any]:
        """The window's figures; `requests`: requests served so far."""
        got = {r: [Answer.from_record(x) for x in self.answers[r]] for r in ROLES}
        figures: dict[str, Any] = {"requests": requests, "first_request": self.first_request,
                                   "segments": sorted(set(self.segments))}  # fmt: skip
        for role in ("adapted", "frozen"):
            cs = got[role]
            figures[f"alpha_{role}"] = _rounded(acceptance(cs), 4, bool(cs))
            figures[f"tau_{role}"] = _rounded(tau(cs), 3, bool(cs))
            figures[f"drafted_{role}"] = sum(a.drafted for a in cs)
            figures[f"accepted_{role}"] = sum(a.accepted for a in cs)
        for role in ROLES:
            cs = got[role]
            figures[f"tokens_per_s_{role}"] = _rounded(tokens_per_second(cs), 1, bool(cs))
        figures["identical"] = identical(got, greedy)
        figures |= {
            "updates": self.updates, "rollbacks": self.rollbacks, "swaps": self.swaps,
            "swap_seconds_max": round(max(self.swap_seconds), 3) if self.swap_seconds else None,
            "write_seconds": (round(statistics.median(self.write_seconds), 3)
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
        f"- swaps {result['swaps']}: the new drafter served after {fmt(result['swap_seconds_max'])}"
        f" s at most (median {fmt(result['swap_seconds_median'])} s; {SWAP[result['engine']]}), "
        f"its weights prepared in {fmt(result['write_seconds_median'])} s (median; learner time, "
        f"between requests)",
        f"- engine restarts {result['restarts']}; requests replayed from the journal on resume "
        f"{result['replayed']}; the resumed engine's drafter identical to the one served "
        f"before: {fmt(result['resumed_same_drafter'])}",
        f"- greedy output identical to the target alone in every window: "
        f"{fmt(result['identical'])}",
        "",
    ]
    return "\n".join(lines)


@dataclass
class ServedResult:
    """result.json of a served run."""

    output_dir: str
    drafter_path: str
    drafter_start: str
    engine: str
    version: str
    k: int
    decoder: str
    requests: int
    updates: int
    rollbacks: int
    swaps: int
    swap_seconds_max: float | None
    swap_seconds_median: float | None
    write_seconds_median: float | None
    restarts: int
    replayed: int
    resumed_same_drafter: bool | None
    identical: bool | None
    final_window: dict[str, Any] | None
    segments: list[dict] = field(default_factory=list)
    wall_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)


def write_result(cfg: Any, s: Any, e: Any, drafter_start: str, job: Any, ver: str,
                 t_start: float) -> ServedResult:  # fmt: skip
    """result.json, online.md and online.png of a finished served run (`job`: its ServedRun)."""
    segments = list(s.segments)
    bounds, labels = boundaries(segments), [seg.label for seg in segments]
    seg = segment_summary(job.rows, bounds, labels)
    sp = s.decoder.sampling
    same = [r["identical"] for r in job.rows if r["identical"] is not None]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    result = ServedResult(
        output_dir=str(s.output_dir), drafter_path=str(s.output_dir / "drafter"),
        drafter_start=drafter_start, engine=e.engine, version=ver.removeprefix("version: "),
        k=s.decoder.gamma,
        decoder="greedy" if sp.greedy else f"sampling T={sp.temperature} top_k={sp.top_k} "
        f"top_p={sp.top_p}", requests=job.pos, updates=job.updates, rollbacks=job.rollbacks,
        swaps=job.swaps, swap_seconds_max=max(job.swap_seconds) if job.swap_seconds else None,
        swap_seconds_median=med(job.swap_seconds), write_seconds_median=med(job.write_seconds),
        restarts=sum(r["restarts"] for r in job.rows), replayed=job.replayed,
        resumed_same_drafter=job.same_drafter, identical=all(same) if same else None,
        final_window=job.rows[-1] if job.rows else None, segments=seg,
        wall_seconds=round(time.perf_counter() - t_start, 1),
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
    )  # fmt: skip
    if s.plot:
        plot(job.rows, bounds, labels, s.output_dir / "online.png")
    atomic_write_text(s.output_dir / "online.md", markdown(asdict(result), job.rows))
    atomic_write_json(s.output_dir / "result.json", result)
    return result
