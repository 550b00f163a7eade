"""The online stage: the drafter q learns from the target p's verdicts while it serves.

    python -m specdistill.distill.online pair=toy-tiny output_dir=DIR
    python -m specdistill.distill.online pair=toy pair.drafter=RUN/distill/best decoder=sampling

Online Speculative Decoding (Liu et al., 2024), at batch size >= 1 and without an extra target
forward: requests of a shifting stream (`specdistill.distill.online.stream`) are decoded
speculatively with `record_probs`, every verified position on the emitted sequence (or only
the rejected ones) goes into a replay buffer with the target's top-k taken from verification
(`specdistill.distill.online.buffer`), and every `update_every` requests the drafter takes
`update_steps` optimizer steps on the buffer (`specdistill.distill.online.update`); the next
request decodes with the updated drafter. A frozen twin decodes the same requests with the same
seeds for the baseline; a guard rolls back an update that lowers alpha on held-out recent
traffic. Checkpoints (drafter, optimizer, buffer, stream position, metrics) are atomic and
written every `save_every` updates and at exit, SIGINT and SIGTERM included; the same command
run again continues the stream (`resume=auto`). The adapted drafter (`output_dir/drafter`) is an ordinary checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json, atomic_write_text
from specdistill.data.models.pairs import load_pair, load_tokenizer, resolve_pair
from specdistill.data.runtime import (
    pad_rows,
    parse_dtype,
    resolve_device,
    run_or_exit,
    set_threads,
)
from specdistill.data.stage_config import check_command_line
from specdistill.decode.speculative import DecodeOutput, SpeculativeDecoder
from specdistill.distill.online.buffer import Entry, ReplayBuffer, entries_from_output
from specdistill.distill.online.config import (
    OnlineSettings,
    check_config,
    check_topk,
    fingerprint,
    removed_keys,
)
from specdistill.distill.online.drift import DriftGate
from specdistill.distill.online.engine_settings import EngineSettings, check_served
from specdistill.distill.online.report import Window, markdown, plot, segment_summary, write_jsonl
from specdistill.distill.online.stream import (
    boundaries,
    load_sources,
    plan_fingerprint,
    plan_requests,
)
from specdistill.distill.online.update import Updater
from specdistill.distill.online.util import (
    StopOnSignal,
    save_checkpoint,
    saved_state,
    wandb_tracker,
)

if TYPE_CHECKING:
    from specdistill.distill.online.in_engine import ServedResult

log = logging.getLogger("specdistill.online")
STATE_FILE = "online_state.pt"


@dataclass
class OnlineResult:
    output_dir: str
    drafter_path: str
    drafter_start: str
    requests: int
    decoder: str
    gamma: int
    loss: str
    record: str
    topk: int
    topk_mass: float  # mean target probability mass the kept top-k covered
    updates: int
    rollbacks: int
    gated_steps: int  # optimizer steps the agreement gate skipped (gate_agreement)
    relaxed_updates: int  # updates whose gate was relaxed after a drop in alpha (online_drift)
    decode_seconds: float
    frozen_decode_seconds: float
    update_seconds: float
    guard_seconds: float
    update_share: float
    buffer_capacity: int
    buffer_peak_mb: float
    final_window: dict[str, Any] | None
    segments: list[dict] = field(default_factory=list)
    wall_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)


class OnlineRun:
    """The serving loop's state and steps; `run` below wires it to the config."""

    def __init__(
        self, cfg: DictConfig, settings: OnlineSettings, plan, prompts, target, drafter, frozen,
        tok, dcfg, topk,
    ) -> None:  # fmt: skip
        """`cfg`: the stage's config (its `optim` and `loss` nodes); `settings`: the rest, typed."""
        self.s, self.out, self.plan, self.prompts, self.tok = (
            settings,
            settings.output_dir,
            plan,
            prompts,
            tok,
        )
        self.topk = topk
        self.run_key = cfg.get("run_key")  # the pipeline step's fingerprint (util.saved_state)
        s = settings
        n = len(tok)
        self.dec = SpeculativeDecoder(target, drafter, dcfg, tokenizer_len=n)
        plain = dataclasses.replace(dcfg, record_probs=False)
        self.guard_dec = SpeculativeDecoder(target, drafter, plain, tokenizer_len=n)
        self.frozen_dec = (
            SpeculativeDecoder(target, frozen, plain, tokenizer_len=n) if frozen else None
        )
        total = (len(plan) // s.update_every) * s.update_steps
        self.updater = Updater(
            drafter, cfg, total, self.dec.vocab, tok.pad_token_id, anchor=frozen, settings=s
        )
        # the start drafter for guard_start without a frozen twin (the anchor's copy if any)
        start = frozen or self.updater.anchor
        if start is None and s.guard_start and s.guard_every > 0:
            start = copy.deepcopy(drafter).requires_grad_(False)
        self.start_dec = (
            SpeculativeDecoder(target, start, plain, tokenizer_len=n) if start else None
        )
        self.buffer = ReplayBuffer(s.buffer_tokens)
        self.drift = DriftGate(s.gate_relax_margin, s.window)
        self.pos, self.updates, self.rollbacks = 0, 0, 0
        self.pending: list[Entry] = []  # kept positions of requests since the last update
        self.recent: list[dict] = []  # served alpha of batches since the last update
        self.window = Window(first_request=0)
        self.rows: list[dict] = []
        keys = ("decode", "frozen", "update", "guard", "mass", "kept", "gated", "relaxed")
        self.totals = dict.fromkeys(keys, 0.0)
        self.outputs: list[dict] = []

    # ------------------------------------------------------------ serving
    def _seed(self, first_request: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.s.seed * 1_000_003 + first_request)

    def _decode(self, dec: SpeculativeDecoder, first: int, rows: list[list[int]]):
        ids, mask = pad_rows(rows, self.tok.pad_token_id)
        t = time.perf_counter()
        out = dec.generate(ids, mask, generator=self._seed(first))
        return out, time.perf_counter() - t

    def serve_batch(self) -> None:
        reqs = self.plan[self.pos : self.pos + self.s.batch_size]
        rows = [self.prompts[r.source][r.prompt] for r in reqs]
        out, secs = self._decode(self.dec, reqs[0].id, rows)
        ids = [r.id for r in reqs]
        kept = entries_from_output(out, rows, ids, self.topk, self.s.record)
        self.totals["mass"] += sum(float(e.topk_lp.exp().sum()) for e in kept)
        self.totals["kept"] += sum(e.tokens for e in kept)
        self.pending += kept
        self.recent.append({"first": reqs[0].id, "rows": rows, "alpha_sum": out.alpha_sum})
        self.recent[-1]["trials"] = out.trials
        self.window.adapted.add(out, secs)
        self.drift.observe(out.alpha_sum, out.trials, len(reqs))
        self.totals["decode"] += secs
        frozen: DecodeOutput | None = None
        if self.frozen_dec is not None:
            frozen, fsecs = self._decode(self.frozen_dec, reqs[0].id, rows)
            self.window.frozen.add(frozen, fsecs)
            self.totals["frozen"] += fsecs
            self.recent[-1]["start"] = (frozen.alpha_sum, frozen.trials)  # for guard_start
        self.window.segments += [r.segment for r in reqs]
        if self.s.log_tokens:
            for j, r in enumerate(reqs):
                row = {"request": r.id, "adapted": out.tokens[j]}
                self.outputs.append(row | ({"frozen": frozen.tokens[j]} if frozen else {}))
        self.pos += len(reqs)

    # ------------------------------------------------------------ updates and guard
    def update(self) -> None:
        s = self.s
        guarded = s.guard_every > 0 and (self.updates + 1) % s.guard_every == 0
        probe_batches = s.guard_probe // s.batch_size if guarded else 0
        probe = self.recent[len(self.recent) - probe_batches :] if probe_batches else []
        held = {r.request for r in self.pending} & {
            b["first"] + i for b in probe for i in range(len(b["rows"]))
        }
        for e in self.pending:
            if e.request not in held:
                self.buffer.add(e)
        snapshot = self.updater.state_dict() if guarded else None
        t = time.perf_counter()
        gated = self.updater.gated
        relaxed = self.drift.decide()
        losses = self.updater.update(self.buffer, self.updates, relaxed)
        self.window.relaxed += int(relaxed)
        self.totals["relaxed"] += int(relaxed)
        secs = time.perf_counter() - t
        self.window.gated += self.updater.gated - gated
        self.totals["gated"] += self.updater.gated - gated
        self.updates, self.window.updates = self.updates + 1, self.window.updates + 1
        self.window.update_seconds += secs
        self.totals["update"] += secs
        self.window.losses += losses
        self.window.agreements += self.updater.agreements
        self.updater.agreements = []
        if guarded:
            t = time.perf_counter()
            before = sum(b["alpha_sum"] for b in probe) / max(1, sum(b["trials"] for b in probe))
            outs = [self._decode(self.guard_dec, b["first"], b["rows"])[0] for b in probe]
            after = sum(o.alpha_sum for o in outs) / max(1, sum(o.trials for o in outs))
            start = self._start_alpha(probe) if s.guard_start else None
            if after < max(before, start or 0.0) - s.guard_margin:
                self.updater.load_state_dict(snapshot)  # type: ignore[arg-type]
                self.rollbacks += 1
                self.window.rollbacks += 1
                log.warning(
                    "guard: update %d rolled back (probe alpha %.3f before, %.3f after, start "
                    "drafter %s, margin %.3f)", self.updates, before, after,
                    "-" if start is None else f"{start:.3f}", s.guard_margin,
                )  # fmt: skip
            secs = time.perf_counter() - t
            self.window.guard_seconds += secs
            self.totals["guard"] += secs
        for e in self.pending:
            if e.request in held:
                self.buffer.add(e)
        self.pending, self.recent = [], []

    def _start_alpha(self, probe: list[dict]) -> float:
        """The starting drafter's alpha on the probe: its frozen twin's decode of those very
        requests (same seeds) when compare_frozen, else one decode with the start drafter."""
        if any("start" not in b for b in probe):
            for b in probe:
                out = self._decode(self.start_dec, b["first"], b["rows"])[0]
                b["start"] = (out.alpha_sum, out.trials)
        return sum(b["start"][0] for b in probe) / max(1, sum(b["start"][1] for b in probe))

    def close_window(self) -> dict:
        row = self.window.row(
            self.pos, self.buffer.tokens, self.buffer.capacity, self.buffer.peak_nbytes
        )
        self.rows.append(row)
        self.window = Window(first_request=self.pos)
        write_jsonl(self.out / "online.jsonl", self.rows)
        return row

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, fp: str) -> dict:
        return {
            "fingerprint": fp,
            "run_key": self.run_key,
            "pos": self.pos,
            "updates": self.updates,
            "rollbacks": self.rollbacks,
            "updater": self.updater.state_dict(),
            "buffer": self.buffer.state_dict(),
            "drift": self.drift.state_dict(),
            "pending": [e.row() for e in self.pending],
            "recent": self.recent,
            "window": self.window.to_state(),
            "rows": self.rows,
            "totals": self.totals,
            "outputs": self.outputs,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.updates = int(state["pos"]), int(state["updates"])
        self.rollbacks = int(state["rollbacks"])
        self.updater.load_state_dict(state["updater"])
        self.buffer.load_state_dict(state["buffer"])
        self.drift.load_state_dict(state["drift"])
        self.pending = [Entry(*row) for row in state["pending"]]
        self.recent, self.rows = state["recent"], state["rows"]
        self.window = Window.from_state(state["window"])
        self.totals, self.outputs = state["totals"], state["outputs"]
        torch.set_rng_state(state["torch_rng"])

    def save(self, fp: str) -> None:
        save_checkpoint(self.out, STATE_FILE, self.state_dict(fp), self.updater.drafter, self.tok,
                        self.rows)  # fmt: skip


def run(cfg: DictConfig) -> OnlineResult | ServedResult:
    """Serve the stream with the drafter learning from the target's verdicts; see the module
    docstring (`engine=llamacpp` or `vllm`: distill/online/in_engine.py). Continues OUT/online_state.pt
    of the same config (resume=auto)."""
    t_start = time.perf_counter()
    s = check_config(cfg)
    engine = EngineSettings.from_cfg(cfg)
    check_served(cfg, s, engine)
    out = s.output_dir
    device = resolve_device(s.device)
    set_threads(s.threads, device)
    dtype = parse_dtype(s.dtype, device)
    spec = resolve_pair(cfg.pair, stage="online")
    checked = None
    if engine.served:  # the engine's binary and files before any prompt or model loads
        from specdistill.distill.online.in_engine import preflight

        checked = preflight(engine, spec)
    tok = load_tokenizer(spec)
    topk = check_topk(s, len(tok))
    sources = load_sources(list(s.segments), spec.toy, tok, target=spec.target)
    plan = plan_requests(
        list(s.segments), {k: len(v) for k, v in sources.items()}, s.stream_blend, s.seed
    )
    fp = fingerprint(cfg, plan_fingerprint(plan))
    # Prompts are tokenised once, cut to their last max_prompt_tokens tokens.
    keep = s.max_prompt_tokens
    prompts = {
        label: [tok(p.text, add_special_tokens=False).input_ids[-keep:] or [tok.eos_token_id]
                for p in plist]
        for label, plist in sources.items()
    }  # fmt: skip
    if engine.served:  # llama-server or vLLM serves the stream (distill/online/in_engine.py)
        from specdistill.distill.online.in_engine import run_served

        return run_served(cfg, s, engine, spec, checked, plan, prompts, fp, t_start)
    state = saved_state(out / STATE_FILE, s.resume, fp, cfg.get("run_key"))

    target, drafter, tok = load_pair(spec, device=device, dtype=dtype)
    target.requires_grad_(False)
    frozen = copy.deepcopy(drafter).requires_grad_(False) if s.compare_frozen else None
    eos = tuple(sorted({i for i in [tok.eos_token_id] if i is not None}))
    # the online learner reads the target's probabilities from every verification; prompt
    # lookup stays off: its rounds' rejections are the context's, not the drafter's, to learn from
    dcfg = s.decoder.replace(record_probs=True, lookup=False).decoder_config(s.max_new_tokens, eos)
    out.mkdir(parents=True, exist_ok=True)
    job = OnlineRun(cfg, s, plan, prompts, target, drafter, frozen, tok, dcfg, topk)
    if state is not None:
        job.load_state_dict(state)
        log.info("resumed at request %d (%d updates)", job.pos, job.updates)
    segments = list(s.segments)
    bounds, labels = boundaries(segments), [seg.label for seg in segments]
    _serve(cfg, s, job, plan, fp, device)
    seg = segment_summary(job.rows, bounds, labels)
    t = job.totals
    serve = t["decode"] + t["update"] + t["guard"]
    sp = dcfg.sampling
    result = OnlineResult(
        output_dir=str(out),
        drafter_path=str(out / "drafter"),
        drafter_start=spec.drafter,
        requests=job.pos,
        decoder="greedy"
        if sp.greedy
        else f"sampling T={sp.temperature} top_k={sp.top_k} top_p={sp.top_p}",
        gamma=dcfg.gamma,
        loss=str(cfg.loss.name),
        record=s.record,
        topk=topk,
        topk_mass=round(t["mass"] / max(t["kept"], 1), 4),
        updates=job.updates,
        rollbacks=job.rollbacks,
        gated_steps=int(t["gated"]),
        relaxed_updates=int(t["relaxed"]),
        decode_seconds=round(t["decode"], 2),
        frozen_decode_seconds=round(t["frozen"], 2),
        update_seconds=round(t["update"], 2),
        guard_seconds=round(t["guard"], 2),
        update_share=round((t["update"] + t["guard"]) / max(serve, 1e-9), 4),
        buffer_capacity=job.buffer.capacity,
        buffer_peak_mb=round(job.buffer.peak_nbytes / 2**20, 4),
        final_window=job.rows[-1] if job.rows else None,
        segments=seg,
        wall_seconds=round(time.perf_counter() - t_start, 1),
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
    )
    if s.log_tokens:
        write_jsonl(out / "outputs.jsonl", job.outputs)
    if s.plot:
        plot(job.rows, bounds, labels, out / "online.png")
    atomic_write_text(out / "online.md", markdown(dataclasses.asdict(result), seg))
    atomic_write_json(out / "result.json", result)
    return result


def _serve(cfg: DictConfig, s: OnlineSettings, job: OnlineRun, plan, fp: str, device) -> None:
    """The serving loop: batches, updates every `update_every` requests, a metrics row per
    window, checkpoints; SIGINT/SIGTERM save and exit (the same command continues)."""
    tracker = wandb_tracker(cfg, device)
    update_every, window = s.update_every, s.window
    with StopOnSignal() as stop:
        while job.pos < len(plan) and stop.signum is None:
            job.serve_batch()
            updated = job.pos % update_every == 0
            if updated:
                job.update()
            if job.pos % window == 0 or job.pos == len(plan):
                row = job.close_window()
                log.info(
                    "requests %d: alpha adapted %s frozen %s, tau %s/%s, %.0f tok/s, update "
                    "share %.3f, buffer %.2f",
                    row["requests"], row["alpha_adapted"], row["alpha_frozen"],
                    row["tau_adapted"], row["tau_frozen"], row["tokens_per_s"],
                    row["update_share"], row["buffer_fill"],
                )  # fmt: skip
                if tracker is not None:
                    tracker.log({f"online/{k}": v for k, v in row.items()}, step=row["requests"])
            if updated and job.updates % s.save_every == 0:
                job.save(fp)
        job.save(fp)
        if stop.signum is not None:
            log.warning(
                "stopped by signal %d at request %d; rerun the same command to continue",
                stop.signum,
                job.pos,
            )
            if tracker is not None:
                tracker.end_training()
            sys.exit(128 + stop.signum)
    if tracker is not None:
        tracker.end_training()


@hydra.main(config_path="pkg://specdistill.conf", config_name="online", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    r = run_or_exit(run, cfg)
    fw = r.final_window or {}
    if not isinstance(r, OnlineResult):  # served by an engine
        print(
            f"online in {r.engine}: {r.requests} requests, {r.updates} updates ({r.swaps} "
            f"swaps, {r.rollbacks} rolled back, {r.restarts} server restarts); final window "
            f"acceptance adapted {fw.get('alpha_adapted')} vs frozen {fw.get('alpha_frozen')}; "
            f"greedy = plain: {r.identical}; drafter: {r.drafter_path}"
        )
        return
    print(
        f"online: {r.requests} requests, {r.updates} updates ({r.rollbacks} rolled back, "
        f"{r.gated_steps} steps gated, {r.relaxed_updates} relaxed); final "
        f"window alpha adapted {fw.get('alpha_adapted')} vs frozen {fw.get('alpha_frozen')}; "
        f"update share {r.update_share}; drafter: {r.drafter_path}"
    )


def main() -> None:
    """`python -m specdistill.distill.online`: a removed or unknown key on the command line is
    one `error:` line (exit 2) before Hydra composes the config, then Hydra's main runs it."""
    check_command_line("online", removed_keys())
    _hydra_main()


if __name__ == "__main__":
    main()
