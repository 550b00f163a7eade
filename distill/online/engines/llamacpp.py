"""llama-server serving the online stage (`engine=llamacpp`): one server process per role, the
drafters as GGUF files, a new drafter put in service blue-green (distill/online/served.py).

Every server is the target with `--spec-draft-n-max K` and a drafter file (`plain`: none). The
adapted drafter's file is `llamacpp/served.gguf`; the frozen one's `llamacpp/frozen.gguf`,
written once from the starting drafter; a candidate is written as `candidate.gguf`, checked by
llama.cpp's drafter rule, and answered by a second process until it is promoted (renamed to
served.gguf, the old process stopped) or dropped (stopped). A resumed stage writes the current
weights again and compares the bytes with served.gguf: the same drafter, or not.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.llamacpp.measure import rounds
from specdistill.decode.llamacpp.server import Completion
from specdistill.distill.online.engine_settings import EngineSettings
from specdistill.distill.online.engines.base import Answer
from specdistill.distill.online.served import Served, ServerSpec

WriteGguf = Callable[[Any, Path], None]


def answer_from(c: Completion) -> Answer:
    """llama-server's answer and timings as the stage keeps them (measure.py: its rounds)."""
    return Answer(tokens=list(c.tokens), drafted=c.draft_n, accepted=c.draft_n_accepted,
                  rounds=rounds(c), decode_ms=c.predicted_ms, prompt_ms=c.prompt_ms)  # fmt: skip


class LlamaCppEngine:
    """The stage's servers (`ServedEngine`): `files` holds the GGUFs and the servers' logs."""

    name = "llamacpp"

    def __init__(self, spec: ServerSpec, files: Path, write_gguf: WriteGguf, binary: Path):
        self.spec, self.files, self.write_gguf, self.binary = spec, files, write_gguf, binary
        self.servers: dict[str, Served] = {}
        self.candidate: Served | None = None

    def prepare(self, drafter: Any, fresh: bool) -> None:
        """The frozen drafter's file (the starting weights, before any update); a fresh run
        forgets what an earlier one served."""
        frozen = self.files / "frozen.gguf"
        if fresh or not frozen.is_file():
            self.write_gguf(copy.deepcopy(drafter), frozen)
        if fresh:
            (self.files / "served.gguf").unlink(missing_ok=True)

    def _write(self, drafter: Any, path: Path) -> float:
        t = time.perf_counter()
        self.write_gguf(drafter, path)
        return time.perf_counter() - t

    def start(self, drafter: Any, roles: Sequence[str], resumed: bool) -> bool | None:
        """The servers on the current weights (checked against the file served before a
        resume) and the starting drafter's file."""
        served, fresh = self.files / "served.gguf", self.files / "served.next.gguf"
        self._write(drafter, fresh)
        same = None
        if served.is_file() and resumed:
            same = served.read_bytes() == fresh.read_bytes()
        os.replace(fresh, served)
        drafts = {"adapted": served, "frozen": self.files / "frozen.gguf", "plain": None}
        for role in roles:
            self.servers[role] = Served(self.spec, role, drafts[role]).start()
        return same

    def answer(self, role: str, ids: list[int], n: int, sampling: Sampling,
               seed: int) -> tuple[Answer, int]:  # fmt: skip
        server = self.candidate if role == "candidate" else self.servers[role]
        assert server is not None, "no candidate offered"
        c, restarts = server.ask(ids, n, sampling, seed)
        return answer_from(c), restarts

    def offer(self, drafter: Any) -> tuple[float, float]:
        """The candidate's GGUF, checked by llama.cpp's drafter rule before it is served, and
        a second server on it: (write seconds, seconds until it answers /health)."""
        from specdistill.decode.llamacpp.files import check_pairing

        path = self.files / "candidate.gguf"
        write = self._write(drafter, path)
        check_pairing(self.spec.target, path, "engine=llamacpp")
        self.candidate, ready = self.servers["adapted"].candidate(path)
        return write, ready

    def settle(self, promoted: bool) -> None:
        candidate, self.candidate = self.candidate, None
        assert candidate is not None, "no candidate offered"
        if promoted:
            self.servers["adapted"] = self.servers["adapted"].promote(
                candidate, self.files / "served.gguf"
            )
        else:
            candidate.stop()
            (self.files / "candidate.gguf").unlink(missing_ok=True)

    def stop(self) -> None:
        for server in [*self.servers.values(), *([self.candidate] if self.candidate else [])]:
            server.stop()
        self.servers, self.candidate = {}, None

    def version(self) -> str:
        from specdistill.decode.llamacpp.server import version

        return version(self.binary).removeprefix("version: ")


def preflight(e: EngineSettings, pair: PairSpec) -> Path:
    """What serving in llama.cpp needs, checked before any prompt or model loads: the built
    binary, a drafter that shares the target's tokens, files llama.cpp can be given."""
    from specdistill.decode.llamacpp.build import llama_server_binary
    from specdistill.decode.llamacpp.files import check_files

    asked = f"engine={e.engine}"
    if pair.vocab == "mapped":
        raise ConfigError(
            f"{asked} with a drafter of its own tokenizer: llama.cpp has no vocabulary mapping; "
            "use engine=ours"
        )
    binary = llama_server_binary(asked)
    check_files(e.target, None, pair, asked)
    return binary


def build(s: Any, e: EngineSettings, pair: PairSpec, binary: Path, drafter: Any, fresh: bool,
          need: int) -> LlamaCppEngine:  # fmt: skip
    """The engine for a checked config (`s`: OnlineSettings; `binary`: what `preflight`
    returned; `need`: the longest context a request takes). Only the drafter is in torch: the
    target is served from its GGUF."""
    from specdistill.data.models.gguf_writer import types_for, write_llama_gguf
    from specdistill.data.models.target_gguf import target_gguf

    target_file = Path(e.target) if e.target else target_gguf(pair.target)
    types = types_for(e.drafter_type, target_file)

    def write_gguf(model: Any, path: Path) -> None:
        write_llama_gguf(model, path, types=types, tokenizer_gguf=target_file,
                         name=f"drafter-{e.drafter_type}")  # fmt: skip

    sampling = s.decoder.sampling
    files = s.output_dir / "llamacpp"
    spec = ServerSpec(binary=binary, target=target_file, k=s.decoder.gamma,
                      threads=e.threads or torch.get_num_threads(), ctx=-(-(need + 8) // 256) * 256,
                      draft_sampling=None if sampling.greedy else "probabilistic",
                      startup_timeout=e.startup_timeout, log_dir=files)  # fmt: skip
    files.mkdir(parents=True, exist_ok=True)
    engine = LlamaCppEngine(spec, files, write_gguf, binary)
    engine.prepare(drafter, fresh)
    return engine
