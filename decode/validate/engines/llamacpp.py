"""llama.cpp as an engine (`engines=[ours,llamacpp]`): the CPU engine users deploy.

On CPUs and laptops a drafter is served by `llama-server -m TARGET.gguf -md DRAFT.gguf`, and
what it is worth there is llama.cpp's acceptance and speed, not our decoder's. So validate can
serve the pair in llama.cpp on its own prompts (the same token ids, max_new_tokens, K, serving
modes and seeds): the target alone and with the drafter, two servers side by side, each prompt
asked of both in turn (`repeats` times) so drift in the machine's speed hits both alike. It
reports llama.cpp's own counters (acceptance = accepted / drafted tokens, tau, tokens/s, the
speedup over its plain decoding), whether greedy output with the drafter equals the plain
output, and our decoder's figures beside them on llama.cpp's footing (`beside_ours`), with
the tau comparison of decode/validate/agreement.py.

The drafter is the very one validate loaded, written as GGUF into `output_dir/llamacpp/`
(`llamacpp.drafter_type`: the target file's recipe by default, so its steps cost llama.cpp the
target's bytes per parameter), or an exported `drafter-*.gguf` (`llamacpp.drafter`); the
target is the pair's own GGUF file or one written once from a Llama checkpoint
(data/models/target_gguf.py). Greedy drafts are q's argmax (llama.cpp's default); sampled runs
use `--spec-draft-sampling probabilistic` (rejection sampling, as ours; `llamacpp.sampled_drafts`)
with llama.cpp's q: the drafter's top 10 at the request's temperature, not its full softmax, so
sampled acceptance is lower than ours by design wherever q's mass spreads past 10 tokens. What
llama.cpp cannot serve (a drafter with its own tokenizer, a non-Llama drafter to write, a
missing binary) is refused before weights load.
Its speeds are this machine's; its acceptance is a function of models, prompts and seeds up to
llama.cpp's own arithmetic (quantised activations).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdistill.data.models.gguf_writer import TARGET_RECIPE
from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError, required, spread
from specdistill.decode.llamacpp.files import ASKED_BY, check_files, drafter_gguf
from specdistill.decode.llamacpp.server import DRAFT_SAMPLING, interleaved
from specdistill.decode.validate.agreement import token_lists, totals_agreement
from specdistill.decode.validate.engines import base
from specdistill.decode.validate.engines.base import EngineDefaults, EngineRun, Job, ReportPart
from specdistill.decode.validate.modes import rate_text, speedup_range

log = logging.getLogger(__name__)
# where our decode differs from how llama.cpp serves (base.caveats)
CAVEATS = {
    "draft_length": "llama.cpp drafts up to a fixed K={gamma}; ours used draft_length={draft_length}",
    "lossy": "llama.cpp verifies losslessly; ours used a lossy lenience: acceptance differs",
    "lookup": "llama.cpp drafts with the drafter alone; ours also by prompt lookup",
    "parallel": "llama.cpp runs the parallel drafter autoregressively (one token a forward)",
}


@dataclass(frozen=True)
class LlamaCppSettings:
    """`llamacpp.*` of conf/validate.yaml."""

    target: str | None  # the target's .gguf; None: the pair's own file, or one written
    drafter: str | None  # the drafter's .gguf; None: written from pair.drafter
    drafter_type: str  # f16, q8_0, q4_0, ... or `target`
    threads: int | None  # None: the stage's CPU threads (torch's, after `threads`)
    p_min: float  # --spec-draft-p-min: llama.cpp stops a round's drafting below it
    # --spec-draft-sampling of the sampled mode: probabilistic (rejection sampling against q =
    # the drafter's top 10) or greedy (q's argmax, accepted when the target samples it)
    sampled_drafts: str

    @classmethod
    def from_node(cls, node: Any) -> LlamaCppSettings:
        """The node checked and typed; a ConfigError names the field and the fix."""
        from specdistill.data.models.gguf_writer import QUANT_TYPES

        out = {}
        for key in ("target", "drafter"):
            value = required(node, key, "llamacpp")
            if value is not None and not Path(str(value)).expanduser().is_file():
                raise ConfigError(
                    f"llamacpp.{key}={value!r} does not exist: point it at a .gguf file, or "
                    "null for " + ("the pair's own" if key == "target" else "one written from it")
                )
            out[key] = str(Path(str(value)).expanduser()) if value is not None else None
        kind = str(required(node, "drafter_type", "llamacpp")).lower()
        if kind not in (*QUANT_TYPES, TARGET_RECIPE):
            raise ConfigError(
                f"llamacpp.drafter_type={kind!r}: choose one of {[*QUANT_TYPES, TARGET_RECIPE]}"
            )
        threads = required(node, "threads", "llamacpp")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):  # fmt: skip
            raise ConfigError(f"llamacpp.threads={threads!r}: a positive integer, or null")
        p_min = required(node, "p_min", "llamacpp")
        if isinstance(p_min, bool) or not isinstance(p_min, int | float) or not 0 <= p_min <= 1:
            raise ConfigError(f"llamacpp.p_min={p_min!r} must lie in [0, 1] (0: off)")
        drafts = required(node, "sampled_drafts", "llamacpp")
        if drafts not in DRAFT_SAMPLING:
            raise ConfigError(
                f"llamacpp.sampled_drafts={drafts!r}: choose one of {list(DRAFT_SAMPLING)}"
            )
        return cls(out["target"], out["drafter"], kind, threads, float(p_min), drafts)


def preflight(settings: LlamaCppSettings, spec: Any) -> Path:
    """Everything llama.cpp needs that can be checked before weights load; the binary's path."""
    from specdistill.decode.llamacpp.build import llama_server_binary

    if spec.vocab == "mapped":
        raise ConfigError(
            f"{ASKED_BY} with a drafter of its own tokenizer: llama.cpp has no vocabulary "
            "mapping (its drafter must share the target's tokens); use engines=[ours]"
        )
    binary = llama_server_binary(ASKED_BY)
    check_files(settings.target, settings.drafter, spec)
    return binary


def mode_row(plains: list, specs: list, greedy: bool) -> dict[str, Any]:
    """One mode's llama.cpp figures from the repeats of `interleaved` (counters: first repeat)."""
    from specdistill.decode.llamacpp.measure import engine_figures, tokens_per_second

    fig = engine_figures(plains[0], specs[0])
    plain_rates = [tokens_per_second(p) for p in plains]
    spec_rates = [tokens_per_second(s) for s in specs]
    base = statistics.median(plain_rates)
    return {
        "acceptance": round(fig.acceptance, 4),
        "tau": round(fig.tau, 3),
        "drafted": fig.drafted,
        "accepted": fig.accepted,
        "rounds": fig.rounds,
        "requests": fig.requests,
        "plain_tokens_per_s": spread(plain_rates),
        "speculative_tokens_per_s": spread(spec_rates),
        "speedup": round(statistics.median(spec_rates) / base, 3) if base else 0.0,
        "speedup_range": speedup_range(plain_rates, spec_rates),
        "identical_to_plain": fig.greedy_identical if greedy else None,
        "mismatched_sequences": len(fig.mismatched),
    }


def category_rows(keys: Sequence[tuple[str, str]], plains: list, specs: list) -> list[dict]:
    """llama.cpp's figures by benchmark set and category (`categories.groups`: each category,
    each set's `all`, the overall `all`), from the first repeat; prompt i is request i."""
    from specdistill.decode.llamacpp.measure import acceptance, tau, tokens_per_second
    from specdistill.decode.validate.categories import groups

    out = []
    for name, category, idx in groups(keys):
        plain, spec = [plains[0][i] for i in idx], [specs[0][i] for i in idx]
        base = tokens_per_second(plain)
        out.append({
            "set": name, "category": category, "requests": len(idx),
            "acceptance": round(acceptance(spec), 4), "tau": round(tau(spec), 3),
            "speedup": round(tokens_per_second(spec) / base, 3) if base else 0.0,
        })  # fmt: skip
    return out


def beside_ours(row: dict[str, Any], mine: Mapping[str, Any]) -> None:
    """Our decoder's figures of the same mode on llama.cpp's footing, into `row["ours"]`, and
    the tau comparison into `row["agreement"]`; nothing without our counters. llama.cpp
    reports totals only, so the per-round spread is ours (`totals_agreement`)."""
    side = base.ours_side(mine)
    if side is None:
        return
    acc, figures = side
    drafted = mine.get("drafted")
    # llama.cpp counts every drafted token, those after a round's first rejection too
    row["ours"] = {"acceptance": round(acc.accepted / drafted, 4) if drafted else None} | figures
    agree = totals_agreement(acc, row["accepted"], row["rounds"])
    row["agreement"] = agree.as_dict("llamacpp", z_digits=2)


class Ready(NamedTuple):
    """What the preflight hands to the run: the settings and llama-server's path."""

    settings: LlamaCppSettings
    binary: Path


def validate_in_llamacpp(job: Job, ready: Ready) -> tuple[dict[str, Any], list[str]]:
    """(report.json's `llamacpp` section, notes): the pair in llama-server in every mode."""
    from specdistill.data.models.target_gguf import target_gguf
    from specdistill.decode.llamacpp.server import LlamaServer, version

    settings, binary, st, ours = ready.settings, ready.binary, job.st, job.beside
    gamma, seed, max_new_tokens = ours.gamma, job.seed, job.max_new_tokens
    target_file = Path(settings.target) if settings.target else target_gguf(st.spec.target)
    drafter_file, drafter = drafter_gguf(settings.drafter, settings.drafter_type, st.drafter,
                                         target_file, job.output_dir / "llamacpp")  # fmt: skip
    prompts = [p for batch in token_lists(st.batches) for p in batch]
    need = max(len(p) for p in prompts) + max_new_tokens + gamma + 8
    ctx = -(-need // 256) * 256
    threads = settings.threads or torch.get_num_threads()
    notes = base.caveats(ours, CAVEATS)
    modes: dict[str, dict[str, Any]] = {}
    for mode, s in job.samplings.items():
        method = None if s.greedy else settings.sampled_drafts
        common = dict(threads=threads, ctx=ctx)
        with (
            LlamaServer(binary, target_file, **common) as plain,
            LlamaServer(binary, target_file, draft=drafter_file, draft_max=gamma,
                        draft_p_min=settings.p_min, draft_sampling=method, **common) as spec,
        ):  # fmt: skip
            for server in (plain, spec):  # warm-up, untimed
                server.complete(prompts[0], 4, temperature=s.temperature, seed=seed)
            plains, specs = interleaved(plain, spec, prompts, s, max_new_tokens, seed, job.repeats)
        row = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
               "draft_sampling": method or "greedy"} | mode_row(plains, specs, s.greedy)  # fmt: skip
        beside_ours(row, ours.modes.get(mode) or {})
        if st.categories:
            row["categories"] = category_rows(st.categories, plains, specs)
        differs = "llama.cpp greedy with the drafter differs from its plain greedy output in {n} sequences"
        note = base.against_plain(row, job, s, [c.tokens for c in plains[0]], differs)
        notes += [note] if note else []
        a = row.get("agreement")
        if a and a["beyond_noise"]:
            why = "" if s.greedy else f" (llama.cpp drafts {method}: q is the drafter's top 10)"
            notes.append(
                f"{mode}: llama.cpp's mean acceptance length {a['llamacpp']} differs from ours "
                f"{a['ours']} by {a['difference']:+.3f} ({abs(a['z']):.1f} standard errors){why}"
            )
        modes[mode] = row
    result = {
        "version": version(binary),
        "binary": str(binary),
        "target": str(target_file),
        "drafter": drafter,
        "k": gamma,
        "p_min": settings.p_min,
        "sampled_drafts": settings.sampled_drafts,
        "threads": threads,
        "ctx": ctx,
        "modes": modes,
        "greedy_identical_to_plain": (modes.get("greedy") or {}).get("identical_to_plain"),
    }
    return result, notes


def _pair(row: dict[str, Any], key: str, mine_key: str | None = None, fmt=str) -> str:
    theirs = row.get(key)
    mine = (row.get("ours") or {}).get(mine_key or key)
    return f"{fmt(theirs)} / {'-' if mine is None else fmt(mine)}"


def llamacpp_table(v: dict[str, Any]) -> list[str]:
    """report.md's section: llama.cpp's figures, ours beside, one column per serving mode."""
    modes = list(v["modes"])
    rows: list[tuple[str, list[str]]] = []
    m = v["modes"]
    rows.append(("acceptance (accepted / drafted tokens), llama.cpp / ours",
                 [_pair(m[x], "acceptance") for x in modes]))  # fmt: skip
    rows.append(("tau (tokens per target round), llama.cpp / ours",
                 [_pair(m[x], "tau") for x in modes]))  # fmt: skip
    rows.append(("llama.cpp drafted / accepted / rounds",
                 [f"{m[x]['drafted']} / {m[x]['accepted']} / {m[x]['rounds']}" for x in modes]))  # fmt: skip
    rows.append(("llama.cpp plain tokens/s, median (min-max)",
                 [rate_text(m[x]["plain_tokens_per_s"]) for x in modes]))  # fmt: skip
    rows.append(("llama.cpp with the drafter tokens/s",
                 [rate_text(m[x]["speculative_tokens_per_s"]) for x in modes]))  # fmt: skip
    rows.append(("speedup over its own plain decoding, llama.cpp / ours",
                 [_pair(m[x], "speedup", fmt=lambda y: f"{y}x") for x in modes]))  # fmt: skip
    rows.append(("greedy output with the drafter = plain output",
                 [str(m[x]["identical_to_plain"]) if m[x]["identical_to_plain"] is not None
                  else "-" for x in modes]))  # fmt: skip
    rows.append(("llama.cpp plain output = our target-only output",
                 [m[x].get("plain_equals_ours_target_only", "-") for x in modes]))  # fmt: skip
    cells = []
    for x in modes:
        a = m[x].get("agreement")
        cells.append("n/a" if not a or a["z"] is None else (
            f"{a['difference']:+.3f} +- {a['noise']:.3f} (z {a['z']}): "
            + ("BEYOND noise" if a["beyond_noise"] else "within noise")))  # fmt: skip
    rows.append(("llama.cpp - ours, mean acceptance length", cells))
    d = v["drafter"]
    what = f"{d.get('type')}, written here" if d.get("written") else "given"
    return [
        "",
        f"## Two engines: our decoder and llama.cpp ({v['version'].removeprefix('version: ')}; "
        f"K={v['k']}, p_min {v['p_min']}, {v['threads']} threads; drafter "
        f"`{Path(d['file']).name}` ({what}, {d['bytes'] / 1e6:.1f} MB))",
        "",
        *base.table(modes, rows),
        "",
        *_category_lines(v),
        "llama.cpp's tokens/s are this machine's; sampled runs draft with "
        f"`--spec-draft-sampling {v.get('sampled_drafts', 'probabilistic')}` (q: the drafter's top "
        "10; ours: its full softmax).",
        "",
    ]


def _category_lines(v: dict[str, Any]) -> list[str]:
    """llama.cpp's tau, acceptance and speedup by set and category, a column pair per mode."""
    modes = [m for m in v["modes"] if v["modes"][m].get("categories")]
    if not modes:
        return []
    head = " | ".join(f"{m}: tau, acceptance, speedup" for m in modes)
    rows = []
    for i, r in enumerate(v["modes"][modes[0]]["categories"]):
        cells = []
        for m in modes:
            c = v["modes"][m]["categories"][i]
            cells.append(f"{c['tau']}, {c['acceptance']}, {c['speedup']}x")
        rows.append(f"| {r['set']} | {r['category']} | {r['requests']} | {' | '.join(cells)} |")
    return [
        "llama.cpp by benchmark set and category (ours: the category table above):",
        "",
        f"| set | category | prompts | {head} |",
        "|---|---|---|" + "---|" * len(modes),
        *rows,
        "",
    ]


SUMMARY_HEAD = [
    "| drafter | mode | acceptance (of drafted), llama.cpp / ours | tau, llama.cpp / ours | "
    "tokens/s with the drafter / plain | speedup, llama.cpp / ours | greedy = plain |",
    "| --- | --- | --- | --- | --- | --- | --- |",
]


def summary_rows(v: dict[str, Any] | None, label: str) -> list[str]:
    """One row per serving mode of a report's `llamacpp` section (summary.md, the card)."""
    if not v:
        return []
    out = []
    for mode, m in v["modes"].items():
        same = m.get("identical_to_plain")
        out.append(
            f"| {label} | {mode} | {_pair(m, 'acceptance')} | {_pair(m, 'tau')} | "
            f"{m['speculative_tokens_per_s']['median']} / {m['plain_tokens_per_s']['median']} | "
            f"{_pair(m, 'speedup', fmt=lambda y: f'{y}x')} | "
            f"{'-' if same is None else ('yes' if same else 'NO')} |"
        )
    return out


def summary_caption(v: dict[str, Any]) -> str:
    """What the rows measured: build, K, the drafter file, threads."""
    d = v["drafter"]
    kind = d.get("type") or Path(d["file"]).name
    return (
        f"In llama.cpp ({v['version'].removeprefix('version: ')}, `llama-server -md`, K={v['k']}, "
        f"p_min {v['p_min']}, drafter GGUF {kind} {d['bytes'] / 1e6:.1f} MB, {v['threads']} "
        "threads; tokens/s and speedups are this machine's):"
    )


class LlamaCppEngine(EngineDefaults):
    """llama.cpp's llama-server (`engines=[ours,llamacpp]`, `llamacpp.*`)."""

    name = "llamacpp"

    def settings(self, cfg: Any) -> LlamaCppSettings:
        """`llamacpp.*` typed and checked."""
        return LlamaCppSettings.from_node(required(cfg, "llamacpp"))

    def preflight(self, cfg: Any, spec: PairSpec, settings: LlamaCppSettings) -> Ready:
        """The binary, the pair's architectures and files (`preflight`)."""
        return Ready(settings, preflight(settings, spec))

    def run(self, job: Job, ready: Ready) -> EngineRun:
        """The pair in llama-server in every serving mode, beside ours."""
        log.info("validate: the pair in llama.cpp's llama-server on the same prompts")
        return EngineRun(*validate_in_llamacpp(job, ready))

    def report(self, record: Mapping[str, Any]) -> ReportPart:
        """report.md's llama.cpp section."""
        return base.own_section(record, self.name, llamacpp_table)

    def summary_lines(self, sections: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
        """summary.md's and the model card's table: a row per (label, `llamacpp` section) and
        serving mode, captioned by the last section; nothing without a section."""
        found = [(label, v) for label, v in sections if v]
        if not found:
            return []
        rows = [row for label, v in found for row in summary_rows(v, label)]
        return ["", summary_caption(found[-1][1]), "", *SUMMARY_HEAD, *rows]


ENGINE = LlamaCppEngine()
