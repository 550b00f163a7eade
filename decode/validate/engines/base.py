"""The engine protocol: one shape for every engine that validates a pair, ours included.

An engine serves validate's own prompts (the same token ids, max_new_tokens, K, serving modes
and seeds) and reports its figures beside our decoder's. Every engine has the same entry points,
called by the stage in this order:

- `settings(cfg)`: its own node typed and checked where the stage starts (ValidateSettings);
- `preflight(cfg, spec, settings)`: every install and config check that needs no weights, before
  any load; what it returns is handed to `run` (a binary's path, the engine's settings);
- `run(job, ready)`: every serving mode on the loaded pair: its report.json section and notes;
- `report(record)`: its rows in report.md's figure table and its own section of report.md;
- `summary_lines(sections)`: its table in the pipeline's summary.md and the model card, where
  it has one.

Ours runs first (`Job.ours` is None for it); every other engine stands beside it through the
helpers here, so the "ours" side and the agreement are computed one way for all. p = target,
q = drafter, K = gamma = drafts a round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from specdistill.data.models.pairs import PairSpec
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DecoderSettings
from specdistill.decode.validate.agreement import Acceptance, same_outputs
from specdistill.decode.validate.loaded import Setup
from specdistill.decode.validate.modes import mode_name


@dataclass(frozen=True)
class Ours:
    """Our decoder's side, which every other engine is measured beside."""

    decoder: DecoderSettings  # the serving mode's decoder as it ran (draft length, lenience, ...)
    parallel: bool  # a parallel (PARD) drafter
    gamma: int
    modes: dict[str, dict[str, Any]]  # report.json's `modes`, with each mode's counters
    speedup: float  # the serving mode's measured speedup on this machine
    greedy_tokens: list[list[int]] | None  # target-only greedy tokens (None: sampled serving)


@dataclass(frozen=True)
class Job:
    """What every engine is given: validate's loaded pair and prompts, how the stage decodes them
    (`decoder`: the serving mode; `other`: the other mode, None when off), and ours."""

    st: Setup
    decoder: DecoderSettings
    other: DecoderSettings | None
    max_new_tokens: int
    repeats: int
    seed: int
    step_time_iters: int
    progress: bool
    output_dir: Path
    passes: dict[str, list] | None  # each mode's timed repeats batch by batch, when kept
    ours: Ours | None = None

    @property
    def samplings(self) -> dict[str, Sampling]:
        """The serving mode's sampling spec, then the other mode's, by mode name."""
        done = [d.sampling for d in (self.decoder, self.other) if d is not None]
        return {mode_name(s.temperature): s for s in done}

    @property
    def beside(self) -> Ours:
        """Ours, for an engine that runs after it."""
        if self.ours is None:
            raise RuntimeError("an engine beside ours ran before ours")
        return self.ours


class EngineRun(NamedTuple):
    """What `run` gives back: report.json's section (ours: its measurement) and report notes."""

    section: Any
    notes: list[str]


class ReportPart(NamedTuple):
    """An engine's share of report.md: rows of the figure table, then lines of its own section."""

    rows: list[tuple[str, str]]
    lines: list[str]


class Engine(Protocol):
    """One engine validate runs a pair in (see the module docstring for the entry points)."""

    name: str  # its name in `engines` and its key in report.json
    runs_last: bool  # it takes over the process (vLLM's threads): run after every other engine

    def settings(self, cfg: Any) -> Any: ...

    def preflight(self, cfg: Any, spec: PairSpec, settings: Any) -> Any: ...

    def run(self, job: Job, ready: Any) -> EngineRun: ...

    def report(self, record: Mapping[str, Any]) -> ReportPart: ...

    def summary_lines(self, sections: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]: ...


class EngineDefaults:
    """What an engine without settings of its own, install checks or a summary table inherits."""

    runs_last = False

    def settings(self, cfg: Any) -> None:
        """No node of its own."""
        return None

    def preflight(self, cfg: Any, spec: PairSpec, settings: None) -> None:
        """Nothing to check beyond the package's own install."""
        return None

    def summary_lines(self, sections: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
        """No table in the pipeline's summary or the model card."""
        return []


def own_section(
    record: Mapping[str, Any], name: str, lines: Callable[[Any], list[str]]
) -> ReportPart:
    """An engine's report.md part that is a section of its own: `lines` of its report.json
    section, nothing when it did not run."""
    section = record.get(name)
    return ReportPart([], lines(section) if section else [])


# ---------------------------------------------------------------- beside ours, one way for all


def caveats(ours: Ours, said: Mapping[str, str]) -> list[str]:
    """One note for each way our decode differed from how the engine serves (`said`: its text
    for each of draft_length, lossy, lookup, parallel; `{gamma}` and `{draft_length}` filled)."""
    differs = {
        "draft_length": ours.decoder.draft_length != "fixed",
        "lossy": ours.decoder.lossy,
        "lookup": bool(ours.decoder.lookup),
        "parallel": ours.parallel,
    }
    return [
        said[key].format(gamma=ours.gamma, draft_length=ours.decoder.draft_length)
        for key, on in differs.items()
        if on and key in said
    ]


def ours_side(mine: Mapping[str, Any]) -> tuple[Acceptance, dict[str, Any]] | None:
    """Our row of one mode (report.json's `modes[mode]`) as every engine shows it beside its
    own: our acceptance record and the figures each engine's row repeats; None without our
    per-position counts."""
    if not mine.get("trials_at"):
        return None
    return Acceptance.from_ours(mine["accepted_at"], mine["trials_at"]), {
        "tau": mine.get("tau"),
        "alpha": mine.get("alpha"),
        "speedup": mine.get("speedup"),
        "target_only_tokens_per_s": mine.get("baseline_tokens_per_s"),
        "speculative_tokens_per_s": mine.get("speculative_tokens_per_s"),
    }


def against_plain(
    row: dict[str, Any], job: Job, s: Sampling, plain_tokens: list[list[int]], differs: str
) -> str | None:
    """Greedy only: whether the engine's plain output equals our target-only output (into
    `row`), and a note when its output with the drafter differs from its plain output
    (`differs`: the note, `{n}` filled with the sequences)."""
    if not s.greedy:
        return None
    ours = job.beside.greedy_tokens
    if ours is not None:
        row["plain_equals_ours_target_only"] = same_outputs(plain_tokens, ours, job.st.eos)
    return None if row["identical_to_plain"] else differs.format(n=row["mismatched_sequences"])


def table(head: Sequence[str], rows: Sequence[tuple[str, Sequence[Any]]]) -> list[str]:
    """A markdown table: `head` names the value columns, each row is (label, cells)."""
    return [
        f"| figure | {' | '.join(head)} |",
        "|---|" + "---|" * len(head),
        *[f"| {k} | {' | '.join(str(c) for c in cells)} |" for k, cells in rows],
    ]
