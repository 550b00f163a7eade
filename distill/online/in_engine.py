"""Online adaptation where the drafter is served: an engine answers the stream, the drafter
learns from what it answered, and the running engine gets each new drafter.

    python -m specdistill.distill.online engine=llamacpp pair=smollm2 pair.drafter=DIR
    python -m specdistill.distill.online engine=vllm pair=smollm2 pair.drafter=DIR

Each request is asked of three roles in turn with the same seed: the target with the adapted
drafter (the one a user is served by), with the frozen starting drafter, and alone
(`llamacpp.compare_plain` / `vllm.compare_plain`). The adapted answer becomes replay-buffer
positions whose label is the target's emitted token (distill/online/engine_settings.py says why
tokens, not log-probabilities), and every `update_every` requests the drafter takes the stage's
usual optimizer steps (distill/online/update.py: its agreement gate and drift relaxation
included). The new weights are offered to the engine as a candidate (llama.cpp: a GGUF and a
second server that takes over once ready, distill/online/engines/llamacpp.py; vLLM: loaded into
the running engine in place, distill/online/engines/vllm.py); on a guarded update the candidate
first answers the probe (the latest requests, held out of the update) and is dropped, the
weights rolled back, if its acceptance in the engine's counters falls more than `guard_margin`
below the serving drafter's on the same requests. The loop sees the engine through the five
calls of `ServedEngine` (distill/online/engines/base.py) only.

Nothing is lost: every answer and every update's outcome is journaled as it happens
(distill/online/journal.py), the drafter, optimizer and buffer are checkpointed every
`save_every` updates and on SIGINT/SIGTERM, and a rerun of the same command replays the
journal past the checkpoint instead of asking again, then brings the engine back on the drafter
it served. A llama-server that dies is restarted and its request asked once more (served.py).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from typing import Any

from omegaconf import DictConfig

from specdistill.data.models.pairs import PairSpec, load_pair, vocab_size
from specdistill.distill.online.buffer import Entry, ReplayBuffer, entry_from_tokens
from specdistill.distill.online.config import OnlineSettings
from specdistill.distill.online.drift import DriftGate
from specdistill.distill.online.engine_settings import EngineSettings
from specdistill.distill.online.engines.base import Answer, ServedEngine, acceptance
from specdistill.distill.online.journal import Journal
from specdistill.distill.online.report import write_jsonl
from specdistill.distill.online.served_report import EngineWindow, ServedResult, write_result
from specdistill.distill.online.stream import Request
from specdistill.distill.online.update import Updater
from specdistill.distill.online.util import StopOnSignal, save_checkpoint, saved_state

log = logging.getLogger("specdistill.online")
STATE_FILE = "online_state.pt"


def weights_digest(model) -> str:
    """A short digest of the drafter's weights: a replayed update is checked against the
    journal's (training is reproducible on one CPU, not across CPUs)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes()[:: max(1, t.numel() // 64)])
    return h.hexdigest()[:16]


class ServedRun:
    """The served loop's state and steps; `run_served` below wires it to the config and an
    engine (distill/online/engines/base.py: `ServedEngine`)."""

    def __init__(self, cfg: DictConfig, s: OnlineSettings, engine: ServedEngine,
                 plan: list[Request], prompts: dict[str, list[list[int]]], drafter, tok,
                 plain: bool) -> None:  # fmt: skip
        self.plain, self.engine, self.started = plain, engine, False
        self.s, self.plan, self.prompts, self.tok = s, plan, prompts, tok
        self.out = s.output_dir
        self.run_key = cfg.get("run_key")
        total = (len(plan) // s.update_every) * s.update_steps
        self.updater = Updater(drafter, cfg, total, vocab_size(drafter), tok.pad_token_id,
                               settings=s)  # fmt: skip
        self.buffer, self.drift = (
            ReplayBuffer(s.buffer_tokens),
            DriftGate(s.gate_relax_margin, s.window),
        )
        self.pos, self.updates, self.rollbacks, self.swaps = 0, 0, 0, 0
        self.pending: list[Entry] = []
        self.recent: list[dict[str, Any]] = []  # the requests since the last update, answered
        self.window, self.rows = EngineWindow(first_request=0), []
        self.swap_seconds: list[float] = []
        self.write_seconds: list[float] = []
        self.journal = Journal(s.output_dir / "journal.jsonl")
        self.replayed, self.same_drafter = 0, None

    # ------------------------------------------------------------ engine
    def roles(self) -> list[str]:
        return ["adapted"] + ["frozen"] * self.s.compare_frozen + ["plain"] * self.plain

    def start_servers(self) -> None:
        """The engine, once the journal has nothing left to replay: adapted on the current
        weights (checked against the drafter served before a resume), frozen on the start."""
        if self.started:
            return
        self.same_drafter = self.engine.start(self.updater.drafter, self.roles(), self.pos > 0)
        self.started = True

    def stop_servers(self) -> None:
        self.engine.stop()
        self.started = False

    # ------------------------------------------------------------ serving
    def replaying(self) -> bool:
        """Whether the journal holds answers from here on (a resumed run catching up)."""
        return max(self.journal.requests, default=-1) >= self.pos

    def seed(self, request: int) -> int:
        return self.s.seed * 1_000_003 + request

    def answer(self, req: Request) -> tuple[dict[str, Any], int]:
        """(answers by role, server restarts): the journal's when it has them, else asked."""
        rec = self.journal.requests.get(req.id)
        if rec is not None:
            self.replayed += 1
            return {r: Answer.from_record(a) for r, a in rec["answers"].items()}, rec["restarts"]
        self.start_servers()
        ids, answers, restarts = self.prompts[req.source][req.prompt], {}, 0
        for role in self.roles():
            answers[role], n = self.engine.answer(
                role, ids, self.s.max_new_tokens, self.s.decoder.sampling, self.seed(req.id)
            )
            restarts += n  # fmt: skip
        self.journal.append("request", req.id, {
            "answers": {r: a.record() for r, a in answers.items()},
            "restarts": restarts})  # fmt: skip
        return answers, restarts

    def serve_one(self) -> None:
        req = self.plan[self.pos]
        answers, restarts = self.answer(req)
        ids = self.prompts[req.source][req.prompt]
        entry = entry_from_tokens(req.id, ids, answers["adapted"].tokens)
        self.pending += [entry] if entry is not None else []
        self.recent.append({"request": req.id, "source": req.source, "prompt": req.prompt,
                            **{r: a.record() for r, a in answers.items()}})  # fmt: skip
        self.window.add(answers, req.segment, restarts)
        a = answers["adapted"]
        self.drift.observe(a.accepted, a.drafted, 1)
        self.pos += 1

    # ------------------------------------------------------------ updates
    def update(self) -> None:
        s = self.s
        guarded = s.guard_every > 0 and (self.updates + 1) % s.guard_every == 0
        probe = self.recent[len(self.recent) - s.guard_probe :] if guarded else []
        held = {p["request"] for p in probe}
        for e in self.pending:
            if e.request not in held:
                self.buffer.add(e)
        journaled = self.journal.updates.get(self.updates + 1)
        if journaled is None and not self.replaying():
            self.start_servers()  # they serve the weights before this update
        snapshot = self.updater.state_dict() if guarded else None
        t = time.perf_counter()
        gated = self.updater.gated
        losses = self.updater.update(self.buffer, self.updates, self.drift.decide())
        self.window.update_seconds += time.perf_counter() - t
        self.window.losses += losses
        self.updater.agreements = []
        self.updates += 1
        self.window.updates += 1
        stepped = len(losses) - (self.updater.gated - gated) > 0  # new weights to serve
        outcome = journaled
        if journaled is not None:
            if journaled.get("digest") != weights_digest(self.updater.drafter):
                log.warning("update %d replayed with other weights than it was served with "
                            "(another CPU?): serving goes on from the replayed weights",
                            self.updates)  # fmt: skip
        elif stepped:
            outcome = self._swap(probe)
            outcome["digest"] = weights_digest(self.updater.drafter)
            self.journal.append("update", self.updates, outcome)
        if outcome is not None:
            self._count(outcome)
            if not outcome["promoted"]:
                self.updater.load_state_dict(snapshot)  # type: ignore[arg-type]
        for e in self.pending:
            if e.request in held:
                self.buffer.add(e)
        self.pending, self.recent = [], []

    def _count(self, outcome: dict[str, Any]) -> None:
        if outcome["promoted"]:
            self.swaps += 1
            self.window.swaps += 1
            self.window.swap_seconds.append(outcome["swap_seconds"])
            self.swap_seconds.append(outcome["swap_seconds"])
        else:
            self.rollbacks += 1
            self.window.rollbacks += 1
        self.window.restarts += outcome.get("restarts", 0)
        self.window.write_seconds.append(outcome["write_seconds"])
        self.write_seconds.append(outcome["write_seconds"])

    def _swap(self, probe: list[dict[str, Any]]) -> dict[str, Any]:
        """The new weights to the engine as the candidate; on a guarded update the candidate
        answers the probe first. Promoted, or dropped (the caller rolls the weights back)."""
        self.start_servers()
        write, ready = self.engine.offer(self.updater.drafter)
        promoted, probe_answers, restarts = True, [], 0
        if probe:
            sampling = self.s.decoder.sampling
            for p in probe:
                ids = self.prompts[p["source"]][p["prompt"]]
                a, n = self.engine.answer("candidate", ids, self.s.max_new_tokens, sampling,
                                          self.seed(p["request"]))  # fmt: skip
                probe_answers.append(a.record())
                restarts += n
            before = acceptance([Answer.from_record(p["adapted"]) for p in probe])
            after = acceptance([Answer.from_record(a) for a in probe_answers])
            start = (acceptance([Answer.from_record(p["frozen"]) for p in probe])
                     if self.s.guard_start else 0.0)  # fmt: skip
            promoted = after >= max(before, start) - self.s.guard_margin
            if not promoted:
                log.warning("guard: update %d dropped (probe acceptance %.3f served, %.3f new, "
                            "margin %.3f)", self.updates, before, after, self.s.guard_margin)  # fmt: skip
        self.engine.settle(promoted)
        return {"promoted": promoted, "swap_seconds": round(ready, 4), "write_seconds":
                round(write, 4), "probe": probe_answers, "restarts": restarts}  # fmt: skip

    def close_window(self) -> dict[str, Any]:
        row = self.window.row(self.pos, self.s.decoder.sampling.greedy)
        self.rows.append(row)
        self.window = EngineWindow(first_request=self.pos)
        write_jsonl(self.out / "online.jsonl", self.rows)
        return row

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, fp: str) -> dict[str, Any]:
        return {
            "fingerprint": fp, "run_key": self.run_key, "pos": self.pos,
            "updates": self.updates, "rollbacks": self.rollbacks, "swaps": self.swaps,
            "updater": self.updater.state_dict(), "buffer": self.buffer.state_dict(),
            "drift": self.drift.state_dict(),
            "pending": [e.row() for e in self.pending],
            "recent": self.recent, "window": self.window.to_state(), "rows": self.rows,
            "swap_seconds": self.swap_seconds, "write_seconds": self.write_seconds,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos, self.updates = int(state["pos"]), int(state["updates"])
        self.rollbacks, self.swaps = int(state["rollbacks"]), int(state["swaps"])
        self.updater.load_state_dict(state["updater"])
        self.buffer.load_state_dict(state["buffer"])
        self.drift.load_state_dict(state["drift"])
        self.pending = [Entry(*row) for row in state["pending"]]
        self.recent, self.rows = state["recent"], state["rows"]
        self.window = EngineWindow.from_state(state["window"])
        self.swap_seconds, self.write_seconds = state["swap_seconds"], state["write_seconds"]

    def save(self, fp: str) -> None:
        save_checkpoint(self.out, STATE_FILE, self.state_dict(fp), self.updater.drafter, self.tok,
                        self.rows)  # fmt: skip


def serve_loop(job: ServedRun, fp: str) -> None:
    """Requests one at a time, an update every `update_every`, a row per window, checkpoints;
    SIGINT/SIGTERM save and exit (the same command continues)."""
    s = job.s
    with StopOnSignal() as stop:
        while job.pos < len(job.plan) and stop.signum is None:
            job.serve_one()
            updated = job.pos % s.update_every == 0
            if updated:
                job.update()
            if job.pos % s.window == 0 or job.pos == len(job.plan):
                row = job.close_window()
                log.info("requests %d: acceptance adapted %s frozen %s, tau %s/%s, swap %s s",
                         row["requests"], row["alpha_adapted"], row["alpha_frozen"],
                         row["tau_adapted"], row["tau_frozen"], row["swap_seconds_max"])  # fmt: skip
            if updated and job.updates % s.save_every == 0:
                job.save(fp)
        job.save(fp)
        if stop.signum is not None:
            log.warning("stopped by signal %d at request %d; rerun the same command to continue",
                        stop.signum, job.pos)  # fmt: skip
            job.stop_servers()
            sys.exit(128 + stop.signum)


def preflight(e: EngineSettings, pair: PairSpec) -> Any:
    """The serving engine's own checks (its install, files, configs), before any prompt or
    model loads; what they found is what `build_engine` builds on (llama.cpp: the binary;
    vLLM: the target's config), so nothing is checked twice."""
    if e.engine == "llamacpp":
        from specdistill.distill.online.engines.llamacpp import preflight as llamacpp

        return llamacpp(e, pair)
    from specdistill.distill.online.engines.vllm import preflight as vllm

    return vllm(pair)


def build_engine(s: OnlineSettings, e: EngineSettings, pair: PairSpec, checked: Any, drafter,
                 prompts: dict[str, list[list[int]]], fresh: bool) -> ServedEngine:  # fmt: skip
    """The engine `e.engine` names, on the starting `drafter` (before a resumed state loads);
    `checked`: what `preflight` returned."""
    need = max(len(p) for ps in prompts.values() for p in ps) + s.max_new_tokens + s.decoder.gamma
    if e.engine == "llamacpp":
        from specdistill.distill.online.engines import llamacpp

        return llamacpp.build(s, e, pair, checked, drafter, fresh, need)
    from specdistill.distill.online.engines import vllm

    dtype = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    return vllm.build(s, e.vllm, pair, checked, drafter, need + 1, dtype)


def run_served(cfg: DictConfig, s: OnlineSettings, e: EngineSettings, pair: PairSpec,
               checked: Any, plan: list[Request], prompts: dict[str, list[list[int]]], fp: str,
               t_start: float) -> ServedResult:  # fmt: skip
    """The served run (module docstring); the stage has checked the config and planned the
    stream and run `preflight` (`checked`: what it returned). Only the drafter loads into torch: the target is the engine's."""
    state = saved_state(s.output_dir / STATE_FILE, s.resume, fp, cfg.get("run_key"))
    _, drafter, tok = load_pair(pair, target=False)
    s.output_dir.mkdir(parents=True, exist_ok=True)
    engine = build_engine(s, e, pair, checked, drafter, prompts, fresh=state is None)
    job = ServedRun(cfg, s, engine, plan, prompts, drafter, tok, e.compare_plain_for())
    if state is None:
        job.journal.reset()
    else:
        job.load_state_dict(state)
        job.journal.load()
        log.info("resumed at request %d (%d updates); the journal holds %d answers",
                 job.pos, job.updates, len(job.journal.requests))  # fmt: skip
    try:
        serve_loop(job, fp)
        ver = engine.version()
    finally:
        job.stop_servers()
    return write_result(cfg, s, e, pair.drafter, job, ver, t_start)
