"""The drafter served by llama-server while it learns: a server that is restarted when it dies,
and a swap of the drafter that drops no request.

llama-server cannot load another draft model into a running process, so a new drafter is
served by a second process (blue-green): the candidate starts on the new GGUF beside the
serving one, answers /health, and only then takes the next request, after which the old
process stops. A rollback never touches the serving process: the candidate is stopped. The
stage asks one request at a time, so the seconds from the candidate's launch to its first
/health answer are the serving time a swap costs; they are measured and reported.

A server that dies is started again on the same file and the request it was answering asked
once more (it had answered nothing); a second failure of the same request stops the run with
the server's last log lines. Standard library and the server wrapper only: no model here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.sampling import Sampling
from specdistill.decode.llamacpp.server import Completion, LlamaServer, LlamaServerError

log = logging.getLogger("specdistill.online")


@dataclass(frozen=True)
class ServerSpec:
    """How every server of the stage is started: the binary, the target file, K and threads."""

    binary: Path
    target: Path
    k: int
    threads: int
    ctx: int
    draft_sampling: str | None  # None: llama.cpp's greedy drafts; probabilistic when sampling
    startup_timeout: float
    log_dir: Path

    def server(self, name: str, draft: Path | None) -> LlamaServer:
        """A (not yet started) server of the target, with `draft` as its drafter if given."""
        extra: dict[str, Any] = {}
        if draft is not None:
            extra = dict(draft=draft, draft_max=self.k, draft_sampling=self.draft_sampling)
        return LlamaServer(self.binary, self.target, ctx=self.ctx, threads=self.threads,
                           startup_timeout=self.startup_timeout,
                           log_path=self.log_dir / f"{name}.log", **extra)  # fmt: skip


def ask(server: LlamaServer, ids: list[int], n: int, s: Sampling, seed: int) -> Completion:
    """One request with the stage's sampling: greedy at temperature 0, else plain sampling."""
    return server.complete(ids, n, temperature=s.temperature, seed=seed, top_k=s.top_k,
                           top_p=s.top_p)  # fmt: skip


class Served:
    """One role's server (`adapted`, `frozen` or `plain`): restarted on the same file when it
    dies; `restarts` counts those restarts."""

    def __init__(self, spec: ServerSpec, name: str, draft: Path | None, generation: int = 0):
        self.spec, self.name, self.draft = spec, name, draft
        self.generation = generation  # swaps so far: each process logs to its own file
        self.server = spec.server(self.log_name, draft)
        self.restarts = 0

    @property
    def log_name(self) -> str:
        return f"{self.name}-{self.generation}"

    def start(self) -> Served:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    @property
    def pid(self) -> int | None:
        """The server process's id (tests kill it to show the restart)."""
        proc = self.server.process
        return proc.pid if proc is not None else None

    def ask(self, ids: list[int], n: int, s: Sampling, seed: int) -> tuple[Completion, int]:
        """(the answer, restarts it took): a dead server is started again on the same file and
        the request asked once more; anything else, or a second failure, is raised."""
        try:
            return ask(self.server, ids, n, s, seed), 0
        except LlamaServerError:
            proc = self.server.process
            if proc is not None and proc.poll() is None:
                raise  # alive and refusing: the request itself is at fault
            log.warning("%s server died (status %s): restarting it on %s and asking again",
                        self.name, proc.poll() if proc else None, self.draft)  # fmt: skip
            self.server.stop()
            self.server = self.spec.server(self.log_name, self.draft)
            self.server.start()
            self.restarts += 1
            return ask(self.server, ids, n, s, seed), 1

    def candidate(self, draft: Path) -> tuple[Served, float]:
        """(a started server on `draft` beside this one, the seconds it took to be ready)."""
        t = time.perf_counter()
        other = Served(self.spec, self.name, draft, self.generation + 1).start()
        return other, time.perf_counter() - t

    def promote(self, candidate: Served, served_file: Path) -> Served:
        """The candidate takes over: its file becomes `served_file` (an atomic rename; the
        running process keeps its open file) and this server stops. Returns the new server."""
        assert candidate.draft is not None
        os.replace(candidate.draft, served_file)
        self.stop()
        if self.server.log_path is not None:  # it stopped cleanly: its log says nothing new
            self.server.log_path.unlink(missing_ok=True)
        candidate.draft, candidate.restarts = served_file, self.restarts
        return candidate
