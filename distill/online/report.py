"""Online-adaptation metrics: per-window figures, online.jsonl, online.md and online.png.

alpha is the decoder's (expected) acceptance rate over the window's acceptance trials, tau the
tokens per target forward; both for the adapted drafter and, with `compare_frozen`, for a
frozen copy of the starting drafter decoding the very same requests with the same seeds.
Update share = (update + guard seconds) / (adapted decode + update + guard seconds): the
serving-time cost a production run (no frozen twin) would pay.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdistill.data.io import atomic_write_text
from specdistill.decode.speculative import DecodeOutput


@dataclass
class Counters:
    """Summable decode counters of one drafter over some requests."""

    alpha_sum: float = 0.0
    trials: int = 0
    block_tokens: int = 0
    row_rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, out: DecodeOutput, seconds: float) -> None:
        self.alpha_sum += out.alpha_sum
        self.trials += out.trials
        self.block_tokens += out.block_tokens
        self.row_rounds += out.row_rounds
        self.tokens += sum(len(t) for t in out.tokens)
        self.seconds += seconds

    @property
    def alpha(self) -> float | None:
        return round(self.alpha_sum / self.trials, 4) if self.trials else None

    @property
    def tau(self) -> float | None:
        return round(self.block_tokens / self.row_rounds, 3) if self.row_rounds else None


@dataclass
class Window:
    """Accumulators of the window being served (checkpointed with the run)."""

    first_request: int
    adapted: Counters = field(default_factory=Counters)
    frozen: Counters = field(default_factory=Counters)
    update_seconds: float = 0.0
    guard_seconds: float = 0.0
    updates: int = 0
    rollbacks: int = 0
    gated: int = 0  # optimizer steps skipped by the agreement gate
    relaxed: int = 0  # updates whose gate was relaxed (a drop in served alpha, online_drift)
    losses: list[float] = field(default_factory=list)
    agreements: list[float] = field(default_factory=list)  # the gate's gradient cosines
    segments: list[int] = field(default_factory=list)

    def row(self, requests: int, buffer_tokens: int, capacity: int, nbytes: int) -> dict:
        serve = self.adapted.seconds + self.update_seconds + self.guard_seconds
        return {
            "window_start": self.first_request,
            "requests": requests,  # requests served when the window closed (window end)
            "segment": max(set(self.segments), key=self.segments.count) if self.segments else 0,
            "alpha_adapted": self.adapted.alpha,
            "alpha_frozen": self.frozen.alpha,
            "tau_adapted": self.adapted.tau,
            "tau_frozen": self.frozen.tau,
            "tokens_per_s": round(self.adapted.tokens / max(self.adapted.seconds, 1e-9), 1),
            "update_seconds": round(self.update_seconds, 3),
            "guard_seconds": round(self.guard_seconds, 3),
            "update_share": round((self.update_seconds + self.guard_seconds) / max(serve, 1e-9), 4),
            "updates": self.updates,
            "rollbacks": self.rollbacks,
            "gated_steps": self.gated,
            "relaxed_updates": self.relaxed,
            "agreement": round(sum(self.agreements) / len(self.agreements), 4)
            if self.agreements
            else None,
            "loss": round(sum(self.losses) / len(self.losses), 5) if self.losses else None,
            "buffer_tokens": buffer_tokens,
            "buffer_fill": round(buffer_tokens / capacity, 4),
            "buffer_mb": round(nbytes / 2**20, 3),
        }

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> Window:
        w = cls(**{k: v for k, v in state.items() if k not in ("adapted", "frozen")})
        w.adapted, w.frozen = Counters(**state["adapted"]), Counters(**state["frozen"])
        return w


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Rewritten whole and atomically, so a resumed run never shows a window twice."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def segment_summary(rows: list[dict], bounds: list[int], labels: list[str]) -> list[dict]:
    """Per segment: first/last window alpha of both drafters, their means, and the frozen
    drafter's drop from the previous segment's last window to this segment's first."""
    edges = [0, *bounds, float("inf")]
    out = []
    for s, label in enumerate(labels):
        seg = [r for r in rows if edges[s] < r["requests"] <= edges[s + 1]]
        if not seg:
            continue

        def mean(key: str, seg: list[dict] = seg) -> float | None:
            vals = [r[key] for r in seg if r[key] is not None]
            return round(sum(vals) / len(vals), 4) if vals else None

        info = {
            "segment": s,
            "source": label,
            "windows": len(seg),
            "first_adapted": seg[0]["alpha_adapted"],
            "first_frozen": seg[0]["alpha_frozen"],
            "last_adapted": seg[-1]["alpha_adapted"],
            "last_frozen": seg[-1]["alpha_frozen"],
            "mean_adapted": mean("alpha_adapted"),
            "mean_frozen": mean("alpha_frozen"),
        }
        if out and info["first_frozen"] is not None and out[-1]["last_frozen"] is not None:
            info["frozen_drop_at_shift"] = round(out[-1]["last_frozen"] - info["first_frozen"], 4)
            info["frozen_mean_drop"] = round(out[-1]["mean_frozen"] - info["mean_frozen"], 4)
        out.append(info)
    return out


def markdown(result: dict, segments: list[dict]) -> str:
    """online.md: per-segment table, final window, overhead and buffer figures."""
    fmt = lambda v: "-" if v is None else f"{v}"  # noqa: E731
    lines = [
        f"# Online adaptation: {Path(result['drafter_start']).name} -> {result['drafter_path']}",
        "",
        f"{result['requests']} requests, decoder {result['decoder']}, gamma {result['gamma']}, "
        f"loss {result['loss']}, record {result['record']}, top-k {result['topk']} "
        f"(covering {result['topk_mass']} of p's mass).",
        "",
        "| segment | source | windows | frozen first -> last | adapted first -> last | "
        "mean frozen / adapted | frozen drop at shift |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in segments:
        lines.append(
            f"| {s['segment']} | {s['source']} | {s['windows']} | {fmt(s['first_frozen'])} -> "
            f"{fmt(s['last_frozen'])} | {fmt(s['first_adapted'])} -> {fmt(s['last_adapted'])} | "
            f"{fmt(s['mean_frozen'])} / {fmt(s['mean_adapted'])} | "
            f"{fmt(s.get('frozen_drop_at_shift'))} |"
        )
    fw = result["final_window"] or {}
    lines += [
        "",
        f"- final window: alpha adapted {fmt(fw.get('alpha_adapted'))} vs frozen "
        f"{fmt(fw.get('alpha_frozen'))}; tau {fmt(fw.get('tau_adapted'))} vs "
        f"{fmt(fw.get('tau_frozen'))}",
        f"- updates {result['updates']}, rolled back by the guard {result['rollbacks']}, "
        f"optimizer steps skipped by the agreement gate {result.get('gated_steps', 0)}, "
        f"updates with the gate relaxed after a drop in alpha {result.get('relaxed_updates', 0)}",
        f"- update + guard share of serving time {result['update_share']:.3f} "
        f"(update {result['update_seconds']:.1f} s, guard {result['guard_seconds']:.1f} s, "
        f"adapted decode {result['decode_seconds']:.1f} s)",
        f"- buffer peak {result['buffer_peak_mb']:.3f} MB ({result['buffer_capacity']} positions "
        f"x top-{result['topk']})",
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], bounds: list[int], labels: list[str], path: Path) -> bool:
    """Windowed alpha against requests for both drafters, segment boundaries marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x = [r["requests"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(x, [r["alpha_adapted"] for r in rows], "o-", ms=3, label="adapted (online)")
    if any(r["alpha_frozen"] is not None for r in rows):
        ax.plot(x, [r["alpha_frozen"] for r in rows], "s--", ms=3, label="frozen (start)")
    for b in bounds:
        ax.axvline(b, color="grey", lw=0.8, ls=":")
    edges = [0, *bounds, max(x) if x else 1]
    for s, label in enumerate(labels):
        ax.text((edges[s] + edges[s + 1]) / 2, 0.02, label, ha="center", fontsize=7)
    ax.set(xlabel="requests served", ylabel="windowed alpha", ylim=(0, 1))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
