"""vLLM as an engine (`engines=[ours,vllm]`): the engine users deploy drafters in.

A drafter that works in our decoder can still fail to load or to pay in vLLM, so validate runs
the same pair and prompts there (decode/validate/vllm_engine.py serves them): the target twice,
plain and with the drafter as draft model, both serving modes, interleaved timed repeats like
ours. It reports vLLM's acceptance counters, both engines' tokens/s and latency, whether greedy
output with the drafter equals plain greedy, and both engines' acceptance on one footing
(decode/validate/agreement.py), saying where they differ beyond sampling noise. A drafter with
its own tokenizer runs as vLLM's TLI (`use_heterogeneous_vocab`): vLLM maps the vocabularies
itself and verifies as usual, so greedy output stays the target's; its mapping is compared with
ours. What vLLM cannot serve is refused before any model loads. Its settings (`vllm.*`) are the
generate backend's engine settings, whose engine arguments data/generate/vllm_engine.py builds,
plus `draft_sample_method`; the two engines share the GPU, half of `gpu_memory_utilization` each.
p = target, q = drafter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.generate.vllm_engine import (
    EngineSettings,
    check_engine_settings,
    require_vllm,
)
from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError, required
from specdistill.decode.drafters.mapped import MappedVocab
from specdistill.decode.validate.agreement import Acceptance, Agreement, agreement, token_lists
from specdistill.decode.validate.engines import base
from specdistill.decode.validate.engines.base import EngineDefaults, EngineRun, Job, ReportPart
from specdistill.decode.validate.mapped import mapped_context
from specdistill.decode.validate.modes import rate_text
from specdistill.decode.validate.vllm_engine import (
    ASKED_BY,
    ENGINE_SHARE,
    check_configs,
    check_servable,
    engines,
    measure_mode,
    model_len,
    sampled_speculation_defect,
)

# vLLM's speculative_config.draft_sample_method (null: its default, 'greedy'): 'greedy' drafts
# q's argmax and, when sampling, accepts it with probability p(x) (q taken as one-hot);
# 'probabilistic' samples drafts from q and accepts with min(1, p/q), as our decoder does.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# where our decode differs from how vLLM serves (base.caveats)
CAVEATS = {
    "draft_length": "vLLM drafts a fixed gamma={gamma}; ours used draft_length={draft_length}",
    "lossy": "vLLM verifies losslessly; ours used a lossy lenience: acceptance differs",
}


@dataclass(frozen=True)
class VllmSettings:
    """`vllm.*` of conf/validate.yaml: the engine settings (the generate backend's) and how
    the speculative engine samples its drafts (None: vLLM's default)."""

    engine: EngineSettings
    draft_sample_method: str | None  # None: vLLM's default


def draft_sample_method(node: Any) -> str | None:
    """`vllm.draft_sample_method`: null (vLLM's default) or one of DRAFT_SAMPLE_METHODS."""
    method = required(node, "draft_sample_method", "vllm")
    if method is not None and method not in DRAFT_SAMPLE_METHODS:
        raise ConfigError(
            f"vllm.draft_sample_method={method!r}: use null (vLLM's default), "
            + " or ".join(DRAFT_SAMPLE_METHODS)
        )
    return method


def check_mapped(cfg: Any, settings: VllmSettings) -> None:
    """What vLLM's TLI cannot run with a drafter of its own tokenizer, one line each: TLI drafts
    greedily and reads the target's tokens mapped to the drafter's ids, so draft sampling must
    stay greedy and ours must run `tli`, or the engines would measure different drafters."""
    method = settings.draft_sample_method
    if method not in (None, "greedy"):
        raise ConfigError(
            f"vllm.draft_sample_method={method!r} with a mapped pair (the drafter has its own "
            "tokenizer): vLLM's use_heterogeneous_vocab drafts greedily only; set it to null"
        )
    context = mapped_context(cfg)
    if context != "tli":
        raise ConfigError(
            f"decoder.mapped_context={context} with engines=[ours,vllm]: vLLM serves a drafter "
            "with its own tokenizer as TLI only, so both engines' acceptance is comparable with "
            "decoder.mapped_context=tli; use it, or engines=[ours]"
        )


def agreement_note(mode: str, a: Agreement) -> str | None:
    """One report line when the engines disagree beyond noise (None when they agree)."""
    if not a.beyond_noise:
        return None
    return (
        f"{mode}: vLLM's mean acceptance length {a.theirs:.3f} differs from ours {a.ours:.3f} by "
        f"{a.difference:+.3f} ({abs(a.z or 0):.1f} standard errors, beyond sampling noise)"
    )


def beside_ours(row: dict[str, Any], mine: Mapping[str, Any], mode: str) -> str | None:
    """Our decoder's figures in vLLM's `row` of `mode`, both acceptances on one footing; the
    note when they disagree beyond sampling noise. Nothing without our per-position counts."""
    side = base.ours_side(mine)
    if side is None:
        return None
    acc, figures = side
    theirs = Acceptance.from_vllm(row["counters"]["drafts"], row["counters"]["per_pos"])
    agree = agreement(acc, theirs)
    row["ours"] = acc.figures() | {"rounds_accepted": f"{acc.rounds} / {acc.accepted}"} | figures
    row["agreement"] = agree.as_dict("vllm")
    return agreement_note(mode, agree)


def vllm_mapping_figures(mapped: MappedVocab) -> dict[str, Any] | None:
    """vLLM's own TLI mapping of the same two tokenizers beside ours (None without vLLM).

    vLLM maps vocabulary strings, ours token bytes, so the engines can draft differently with
    the same weights. Counted on the models' rows: drafter ids whose proposal maps elsewhere,
    and target ids read as another drafter id; nonzero counts explain an acceptance gap that
    is not sampling noise."""
    try:
        from vllm.v1.spec_decode.vocab_mapping import VocabMapping as VllmMapping
    except ImportError:
        return None
    ours = mapped.mapping
    theirs = VllmMapping(
        mapped.target_tokenizer, mapped.draft_tokenizer, ours.target_vocab, ours.draft_vocab, "cpu"
    )
    t_ids = torch.arange(ours.target_vocab)
    ours_read = ours.target_to_draft.where(ours.target_to_draft >= 0, mapped.draft_unk)
    return {
        "intersection_vllm": theirs.intersection_size,
        "intersection_ours": ours.intersection_size,
        "draft_ids_mapped_differently": int(
            (theirs.draft_to_target_ids.cpu() != ours.draft_to_target).sum()
        ),
        "target_ids_read_differently": int(
            (theirs.map_target_to_draft_ids(t_ids).cpu() != ours_read).sum()
        ),
    }


def mapping_beside_ours(mapped: MappedVocab, notes: list[str]) -> dict[str, Any] | None:
    """vLLM's own TLI mapping of the two tokenizers against ours; a note where they differ."""
    m = vllm_mapping_figures(mapped)
    if m and (m["draft_ids_mapped_differently"] or m["target_ids_read_differently"]):
        notes.append(
            f"vLLM's TLI mapping differs from ours on {m['draft_ids_mapped_differently']} "
            f"drafter ids and {m['target_ids_read_differently']} target ids (each engine "
            "maps the tokenizers itself): the engines' acceptance may differ by more than noise"
        )
    return m


def validate_in_vllm(job: Job, settings: VllmSettings) -> tuple[dict[str, Any], list[str]]:
    """(report.json's `vllm` section, notes): both engines of vLLM in every serving mode."""
    import vllm

    st, ours = job.st, job.beside
    gamma, method, engine = ours.gamma, settings.draft_sample_method, settings.engine
    parallel = ours.decoder.drafting == "parallel"
    prompts = token_lists(st.batches)
    need = max(len(p) for b in prompts for p in b) + job.max_new_tokens + gamma + 1
    length = model_len(engine, st.target.config, need)
    dtype = str(st.dtype).removeprefix("torch.")
    notes = base.caveats(ours, CAVEATS)
    modes: dict[str, dict[str, Any]] = {}
    with engines(
        st.spec, engine, dtype=dtype, max_model_len=length, seed=job.seed, gamma=gamma,
        method=method, parallel=parallel,
    ) as (plain, speculative):  # fmt: skip
        defect = sampled_speculation_defect()  # after the engines: their kernels are registered
        for mode, s in job.samplings.items():
            row = measure_mode(
                plain, speculative, prompts, s, job.max_new_tokens, st.eos, job.seed, job.repeats
            )
            if defect and not s.greedy:
                row["engine_defect"] = defect
                notes.append(f"{mode}: {defect}")
            plain_tokens = row.pop("plain_tokens")
            note = beside_ours(row, ours.modes.get(mode) or {}, mode)
            differs = (
                "vLLM greedy with the drafter differs from its plain greedy output in {n} "
                f"sequences (near-ties in {st.dtype}?)"
            )
            notes += [
                n for n in (note, base.against_plain(row, job, s, plain_tokens, differs)) if n
            ]
            modes[mode] = row
    result = {
        "version": getattr(vllm, "__version__", "unknown"),
        "method": "draft_model",
        "parallel_drafting": parallel,
        "use_heterogeneous_vocab": st.spec.vocab == "mapped",
        "num_speculative_tokens": gamma,
        "draft_sample_method": method or "vLLM's default (greedy)",
        "dtype": dtype,
        "settings": {
            "tensor_parallel_size": engine.tensor_parallel_size,
            "gpu_memory_utilization_per_engine": engine.gpu_memory_utilization * ENGINE_SHARE,
            "enforce_eager": engine.enforce_eager,
            "max_model_len": length,
        },
        "modes": modes,
        "greedy_identical_to_plain": (modes.get("greedy") or {}).get("identical_to_plain"),
    }
    if st.mapped is not None:
        result["vocab_mapping"] = mapping_beside_ours(st.mapped, notes)
    return result, notes


def two_engine_table(v: Mapping[str, Any]) -> list[str]:
    """Our decoder and vLLM side by side, one column pair per serving mode."""
    modes = list(v["modes"])
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, ours_key, vllm_key, fmt=str) -> None:
        cells = []
        for m in modes:
            row, mine = v["modes"][m], v["modes"][m].get("ours") or {}
            cells += [fmt(mine.get(ours_key)) if ours_key else "", fmt(row.get(vllm_key))]
        rows.append((label, cells))

    add("acceptance rate (accepted / drafts tested)", "acceptance_rate", "acceptance_rate")
    add("mean acceptance length (1 + accepted per round)", "mean_acceptance_length", "mean_acceptance_length")  # fmt: skip
    add("accepted by draft position (share of rounds)", "accepted_by_position", "accepted_by_position")  # fmt: skip
    add("rounds with drafts / accepted (of drafted)", "rounds_accepted", "counters",
        lambda x: x if not isinstance(x, dict) else f"{x['drafts']} / {x['accepted_tokens']} (of {x['draft_tokens']})")  # fmt: skip
    add("target-only tokens/s, median (min-max)", "target_only_tokens_per_s", "plain_tokens_per_s", rate_text)  # fmt: skip
    add("speculative tokens/s, median (min-max)", "speculative_tokens_per_s", "speculative_tokens_per_s", rate_text)  # fmt: skip
    add("speedup (measured)", "speedup", "speedup", lambda x: f"{x}x")
    add("latency per call, target-only ms", None, "plain_latency_ms", rate_text)
    add("latency per call, speculative ms", None, "speculative_latency_ms", rate_text)
    add("speculative greedy output = plain greedy output", None, "identical_to_plain",
        lambda x: "" if x is None else str(x))  # fmt: skip
    cells = []
    for m in modes:
        a = v["modes"][m].get("agreement")
        text = "n/a" if not a else (
            f"{a['difference']:+.3f} +- {a['noise']:.3f} (z {a['z']}): "
            + ("BEYOND noise" if a["beyond_noise"] else "within noise")
        )  # fmt: skip
        cells += ["", text]
    rows.append(("vLLM - ours, mean acceptance length", cells))
    head = [f"{who}, {m}" for m in modes for who in ("ours", "vLLM")]
    return [
        "",
        f"## Two engines: our decoder and vLLM {v['version']} (`{v['method']}`"
        f"{', parallel drafting' if v.get('parallel_drafting') else ''}"
        f"{', TLI: use_heterogeneous_vocab' if v.get('use_heterogeneous_vocab') else ''}, "
        f"{v['num_speculative_tokens']} speculative tokens, {v['dtype']}, draft sampling: "
        f"{v.get('draft_sample_method', 'n/a')})",
        "",
        *base.table(head, rows),
        "",
        *_mapping_line(v.get("vocab_mapping")),
    ]


def _mapping_line(m: Mapping[str, Any] | None) -> list[str]:
    """vLLM's own TLI mapping beside ours (a drafter with its own tokenizer), one line."""
    if not m:
        return []
    return [
        f"TLI mapping: vLLM {m['intersection_vllm']} / ours {m['intersection_ours']} drafter ids "
        f"in the intersection; {m['draft_ids_mapped_differently']} drafter ids and "
        f"{m['target_ids_read_differently']} target ids mapped differently by the two engines.",
        "",
    ]


class VllmEngine(EngineDefaults):
    """vLLM (`engines=[ours,vllm]`); last, because vLLM takes over the process's threads. The
    pipeline's vLLM lines come from export's own run (distill/export/in_vllm.py)."""

    name = "vllm"
    runs_last = True

    def settings(self, cfg: Any) -> VllmSettings:
        """`vllm.*` typed and checked."""
        node = cfg.vllm
        return VllmSettings(check_engine_settings(node), draft_sample_method(node))

    def preflight(self, cfg: Any, spec: PairSpec, settings: VllmSettings) -> VllmSettings:
        """Every check that needs no weights, before anything loads: a mapped pair's settings,
        both configs, vLLM itself (installed, recent enough, serving both architectures)."""
        from transformers import AutoConfig

        if spec.vocab == "mapped":
            check_mapped(cfg, settings)

        def config(name: str, rev: str | None) -> Any:
            return AutoConfig.from_pretrained(
                name, revision=rev, trust_remote_code=spec.trust_remote_code
            )

        target = config(spec.target, spec.revision)
        drafter = config(spec.drafter, spec.drafter_revision)
        check_configs(target, drafter, spec.drafter, mapped=spec.vocab == "mapped")
        vllm = require_vllm(ASKED_BY)  # installed, and a release inside the tested range
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        check_servable(target, drafter, on_cpu, list(vllm.ModelRegistry.get_supported_archs()))
        return settings

    def run(self, job: Job, ready: VllmSettings) -> EngineRun:
        """The pair in vLLM in every serving mode, beside ours."""
        return EngineRun(*validate_in_vllm(job, ready))

    def report(self, record: Mapping[str, Any]) -> ReportPart:
        """report.md's two-engine section."""
        return base.own_section(record, self.name, two_engine_table)


ENGINE = VllmEngine()
