"""The exported drafter's model card (README.md): provenance, measured figures, how to serve it.

Figures come from the validate stage's report.json and the distill stage's result.json; each
says how it was measured, because "alpha" means different things in different places
(decode-time acceptance of our speculative decoder vs. expected acceptance on held-out text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdistill.decode.config import DEFAULT_GAMMA
from specdistill.distill.export.deploy import Deployment
from specdistill.distill.export.gguf_files import gguf_section
from specdistill.distill.export.hub import is_hub_id


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def card_metadata(
    *,
    target: str,
    base_drafter: str,
    k: int,
    vocab: str,
    license: str | None = None,
    extra_tags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The Hub's model-card metadata (huggingface_hub's ModelCardData keys): `base_model` only
    when the drafter's starting checkpoint is a hub id, `license` only when the pair config names
    one (never guessed), and the target under `specdistill` (a drafter is not a fine-tune of its
    target, so no `base_model_relation` names it)."""
    meta: dict[str, Any] = {}
    if is_hub_id(base_drafter):
        meta["base_model"] = base_drafter
    if license:
        meta["license"] = str(license)
    return meta | {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["speculative-decoding", "draft-model", "specdistill", *extra_tags],
        "specdistill": {"target": target, "num_speculative_tokens": k, "vocab": vocab},
    }


def front_matter(meta: dict[str, Any]) -> list[str]:
    """The card's YAML header, written by huggingface_hub as the Hub reads it."""
    from huggingface_hub import ModelCardData

    return ["---", ModelCardData(**meta).to_yaml(), "---", ""]


def provenance(result: Any) -> list[str]:
    """Where the exported weights came from (result: an ExportResult)."""
    return [
        "## Provenance",
        "",
        f"- target: `{result.target}`",
        f"- base drafter: `{result.base_drafter}`",
        f"- exported from: `{result.drafter}` ({result.parameters:,} parameters, {result.dtype})",
    ]


def transformers_usage(target: str, drafter: str, *, own_tokenizer: bool = False) -> list[str]:
    """A Python block of `transformers` assisted generation with this drafter; with its own
    tokenizer, universal assisted generation (both tokenizers)."""
    if own_tokenizer:
        load = [f'drafter_tok = AutoTokenizer.from_pretrained("{drafter}")']
        call = [
            "out = target.generate(**inputs, assistant_model=drafter, tokenizer=tok,",
            "                      assistant_tokenizer=drafter_tok, max_new_tokens=64)",
        ]
    else:
        load = []
        call = ["out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)"]
    return [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("{target}")',
        f'target = AutoModelForCausalLM.from_pretrained("{target}")',
        f'drafter = AutoModelForCausalLM.from_pretrained("{drafter}")',
        *load,
        'inputs = tok("def fibonacci(n):", return_tensors="pt")',
        *call,
        "```",
    ]


def engine_settings(report: dict[str, Any] | None) -> dict[str, Any]:
    """The K to serve with and the engines' flags for it. K: the validate report's recommended K
    (the cost model's argmax over measured acceptance by position) at the first cost model a
    user gave for batch 1 (their hardware), else at the validating machine's costs; else the K
    validate ran; else the default. A recommendation no K pays at is kept, and said so."""
    rec = (report or {}).get("recommended_k") or {}
    by_cost = rec.get("by_cost") or []
    users = [e for e in by_cost[1:] if e.get("batch", 1) == 1]
    chosen = (users or by_cost or [None])[0]
    if chosen is not None:
        k = int(chosen["k"])
        source = (
            f"recommended by validate for {chosen['label']}: modeled speedup "
            f"{chosen['speedup']}x at c {chosen['c']}, verify +{chosen['verify_per_token']} "
            f"per draft, from acceptance by position up to K={rec.get('max_k')}"
        )
        if not chosen.get("pays", True):
            source += " (no K beats target-only decoding at these costs)"
    elif report:
        k, source = int(report["gamma"]), "the K validate ran (its report has no recommendation)"
    else:
        k, source = DEFAULT_GAMMA, "the default (no validate report was given)"
    return {
        "k": k,
        "source": source,
        "machine_priced": chosen is not None and not users,
        "by_batch": {str(e.get("batch", 1)): e["k"] for e in by_cost[1:]} or None,
        "vllm": {"num_speculative_tokens": k},
        "sglang": {"--speculative-num-steps": k, "--speculative-num-draft-tokens": k + 1},
        "llama_cpp": {"--spec-draft-n-max": k},
    }


def engine_section(settings: dict[str, Any]) -> list[str]:
    """The card's recommended K and each engine's flag for it."""
    k = settings["k"]
    lines = [
        "## Recommended number of drafts (K)",
        "",
        f"**K = {k}**: {settings['source']}.",
        "",
        f"- vLLM: `num_speculative_tokens={k}`",
        f"- SGLang: `--speculative-num-steps {k} --speculative-num-draft-tokens {k + 1}`",
        f"- llama.cpp: `--spec-draft-n-max {k}`",
    ]
    if settings.get("machine_priced"):
        lines.append(
            "- priced at the validating machine's step costs; for your hardware rerun validate "
            "with `cost_model=[{batch: 1, c: C, verify_per_token: V}]` (C: a drafter step in "
            "target steps, V: what each draft adds to the verify)"
        )
    if settings.get("by_batch"):
        per = ", ".join(f"batch {b}: K={n}" for b, n in settings["by_batch"].items())
        lines.append(f"- per batch size, at the costs given for each: {per}")
    return [*lines, ""]


def self_check_section(check: dict[str, Any]) -> list[str]:
    """What the self-check found on the written folder, one line a finding."""
    return ["## Self-check at export", "", *[f"- {k}: {v}" for k, v in check.items()], ""]


def _positions(values: list[float] | None) -> str | None:
    return " ".join(f"{x:.2f}" for x in values) if values else None


def _figures(report: dict[str, Any]) -> list[str]:
    modes = report.get("modes") or {}
    greedy, sampled = modes.get("greedy") or {}, modes.get("sampling") or {}
    hf = report.get("hf_assisted") or {}
    k = report.get("gamma")
    rows = [
        (f"tau at K={k} (tokens per round, bonus included), greedy", report.get("tau")),
        (f"tau at K={k}, temperature 1", report.get("tau_sampled")),
        ("acceptance by draft position, greedy", _positions(greedy.get("acceptance_by_position"))),
        ("acceptance by draft position, temperature 1", _positions(sampled.get("acceptance_by_position"))),
        ("alpha, greedy (decode-time acceptance rate)", report.get("alpha")),
        ("alpha at temperature 1 (decode-time)", report.get("alpha_sampled")),
        ("output identical to the target's (greedy)", report.get("lossless")),
        (f"speedup over target-only decoding, measured on {report.get('machine') or 'the validating machine'}", report.get("speedup")),
        ("c there (drafter / target step time)", report.get("c")),
        ("modeled speedup at that c (cost model)", report.get("theoretical_speedup")),
        ("`transformers` assisted generation speedup there", hf.get("speedup")),
    ]  # fmt: skip
    lines = ["| figure | value |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    return lines


def vllm_section(v: dict[str, Any] | None) -> list[str]:
    """vLLM's own figures for this folder, beside our decoder's (when `vllm.enabled`)."""
    if not v:
        return []
    lines = [
        "## Measured in vLLM",
        "",
        f"This folder was served by vLLM {v.get('version')} as a draft model (`draft_model`, "
        f"{v.get('num_speculative_tokens')} speculative tokens, {v.get('dtype')} on "
        f"{v.get('device')}) on {v.get('prompts')} held-out prompts x {v.get('max_new_tokens')} "
        f"new tokens, median of {v.get('repeats')} timed repeats; acceptance from vLLM's own "
        "`vllm:spec_decode_*` counters, next to our decoder's on the same prompts. Mean "
        "acceptance length = 1 + accepted drafts per round.",
        "",
        "| mode | acceptance rate, vLLM / ours | mean acceptance length, vLLM / ours | "
        "speedup in vLLM | our decoder's speedup |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, m in (v.get("modes") or {}).items():
        flag = " (differ beyond noise)" if m.get("beyond_noise") else ""
        lines.append(
            f"| {mode} (T={_fmt(m.get('temperature'))}) | {_fmt(m.get('acceptance_rate'))} / "
            f"{_fmt(m.get('ours_acceptance_rate'))}{flag} | "
            f"{_fmt(m.get('mean_acceptance_length'))} / {_fmt(m.get('ours_mean_acceptance_length'))} "
            f"| {_fmt(m.get('speedup'))}x | {_fmt(m.get('ours_speedup'))}x |"
        )
    lines += [
        "",
        f"- vLLM's greedy output with this drafter equals its plain greedy output: "
        f"{_fmt(v.get('greedy_identical_to_plain'))}",
    ]
    lines += [f"- {mode}: {m['engine_defect']}" for mode, m in (v.get("modes") or {}).items() if m.get("engine_defect")]  # fmt: skip
    return [*lines, ""]


def parallel_section(result: Any, gamma: int) -> list[str]:
    """A parallel (PARD) drafter's mask token and the engines that draft in parallel with it;
    empty for other drafters."""
    mask_id = (result.check or {}).get("mask_token_id")
    if mask_id is None:
        return []
    return [
        "## Parallel drafting (PARD)",
        "",
        f"This drafter was trained to draft a whole round in one forward: it reads the context "
        f"followed by gamma-1 copies of the mask token **id {mask_id}** (the tokenizer's pad "
        "token, a reserved id: the vocabulary size is the target's) and predicts the next gamma "
        "tokens at once. config.json carries the id as `mask_token_id` and `pard_token`. Used "
        "as an ordinary `assistant_model` it drafts autoregressively and works as well (checked "
        "at export). The vLLM lines above set `parallel_drafting`; without it vLLM drafts with "
        "it autoregressively.",
        "",
        "TensorRT-LLM: `PARDDecodingConfig(speculative_model=..., max_draft_len="
        f"{gamma}, mask_token_id={mask_id})`.",
        "",
        "specdistill: `python -m specdistill.decode.validate pair=... pair.drafter="
        f"{result.output_dir} decoder.drafting=parallel decoder.gamma={gamma}`.",
        "",
    ]


def _exported_rows(result: Any) -> list[str]:
    """Provenance lines on what the export changed in the drafter's rows and head."""
    lines = []
    if result.source_vocab_size != result.vocab_size:
        lines.append(
            f"- vocabulary rows {result.source_vocab_size} -> {result.vocab_size}: padding rows "
            "only (no token of the tokenizer moved)"
        )
    if getattr(result, "draft_vocab", 0):
        lines.append(
            f"- draft vocabulary: config.json `draft_vocab_ids` lists {result.draft_vocab} token "
            "ids (the most frequent in its training rows); specdistill's decoder scores only "
            "those in its draft steps (still lossless: q is 0 elsewhere), other engines ignore "
            "the key and run the full head; `speculative_token_map.pt` holds the same ids for "
            "SGLang's `--speculative-token-map`"
        )
    if getattr(result, "padded_head_rows", 0):
        lines.append(
            f"- trained over its draft vocabulary (`draft_vocab_train`): the {result.padded_head_rows}"
            " LM-head rows outside it are the centroid of the rows inside (head untied), so "
            "greedy drafts in engines that run the full head (vLLM, transformers) never leave the "
            "draft vocabulary; sampled drafts there can (each outside row weighs an average kept "
            "token): serve greedy, or with specdistill's decoder"
        )
    return lines


def _distillation(distill: dict[str, Any] | None) -> list[str]:
    """Provenance lines from the distill stage's result.json (none without one)."""
    if not distill:
        return []
    loss = distill.get("loss") or {}
    data = distill.get("data") or {}
    return [
        f"- distillation: loss `{loss.get('name', loss.get('_target_', loss))}`, "
        f"{distill.get('steps')} steps, {distill.get('tokens')} tokens, lmbda (on-policy "
        f"share) {distill.get('lmbda')}, {distill.get('world_size')} process(es)",
        f"- data: `{data.get('path') or 'n/a'}` ({data.get('train_examples')} rows; "
        f"target-generated Seq-KD data when a path is given; reference completions: "
        f"{data.get('reference')})",
        *_chat_line(data.get("chat")),
        f"- held-out alpha (expected acceptance sum_x min(p, q) at temperature "
        f"1 on {data.get('eval_source', 'reference')} completions, {data.get('eval_tokens')} "
        f"tokens): {_fmt(distill.get('alpha_before'))} before, "
        f"{_fmt(distill.get('alpha_after'))} after",
    ]


def _chat_line(chat: dict[str, Any] | None) -> list[str]:
    """Chat traffic: how the rows were made, and the template arguments to serve with."""
    if not chat:
        return []
    kwargs = chat.get("template_kwargs") or {}
    serve = (
        f"serve with the same chat template arguments: `chat_template_kwargs={kwargs}`"
        if kwargs
        else "rendered with the target's chat template, no template arguments"
    )
    trained = chat.get("trained_template_kwargs") or []
    if len(trained) > 1:  # the pipeline's chat_modes: one Seq-KD set per mode, served first
        modes = ", ".join(f"`{k}`" for k in trained)
        serve = (
            f"trained on every mode ({modes}); the served mode, the one validated as "
            f"`validate`: `chat_template_kwargs={kwargs}`"
        )
    return [
        f"- chat traffic: every assistant turn regenerated by the target in order (conversations "
        f"of up to {chat.get('turns')} turns); {serve}"
    ]


def _measured(report: dict[str, Any] | None) -> list[str]:
    """The validate report's figures, with how they were measured."""
    lines = ["", "## Measured", ""]
    if not report:
        return [*lines, "No validate report was given to the export: no figures."]
    return [
        *lines,
        f"Measured by `specdistill.decode.validate.stage` on {report.get('prompts')} held-out prompts "
        f"x {report.get('max_new_tokens')} new tokens, batch {report.get('batch_size')}, "
        f"on {report.get('device')} in {report.get('dtype')}, median of "
        f"{report.get('repeats')} timed repeats, K={report.get('gamma')} drafts a round. tau and "
        "acceptance by position are the same on any machine; the speed figures are the "
        "validating machine's. Greedy figures come from greedy decoding, the temperature-1 "
        "ones from sampling at temperature 1.",
        "",
        *_figures(report),
    ]


def _bash(*commands: str | None) -> list[str]:
    return ["```bash", *[c for c in commands if c], "```"]


def use_section(deploy: Deployment, k_source: str) -> list[str]:
    """How to serve the pair in every engine (export/deploy.py builds every line)."""
    return [
        "## Use",
        "",
        f"vLLM, SGLang and llama.cpp draft K = {deploy.k} tokens a round: {k_source}.",
        "",
        "`transformers`:",
        "",
        *transformers_usage(deploy.target, deploy.drafter, own_tokenizer=deploy.vocab == "mapped"),
        "",
        "vLLM (draft-model speculative decoding), in Python or as an OpenAI-compatible server:",
        "",
        "```python",
        "from vllm import LLM",
        deploy.vllm_python,
        "```",
        "",
        *_bash(deploy.vllm_serve),
        "",
        "SGLang (standalone draft model):",
        "",
        *(_bash(deploy.sglang) if deploy.sglang else []),
        *([f"- {deploy.notes['sglang']}"] if "sglang" in deploy.notes else []),
        "",
        "llama.cpp (GGUF):",
        "",
        *(_bash(deploy.llama_fetch, deploy.llama_server) if deploy.llama_server else []),
        *([f"- {deploy.notes['llama_cpp']}"] if "llama_cpp" in deploy.notes else []),
        *([f"- {deploy.notes['head']}"] if "head" in deploy.notes else []),
        "",
    ]


def model_card(
    result: Any,
    report: dict[str, Any] | None,
    distill: dict[str, Any] | None,
    deploy: Deployment,
    license: str | None = None,
) -> str:
    """README.md for the exported folder (result: an ExportResult; deploy: its lines)."""
    target = result.target
    engines = engine_settings(report)
    meta = card_metadata(
        target=deploy.target,
        base_drafter=result.base_drafter,
        k=deploy.k,
        vocab=deploy.vocab,
        license=license,
    )
    lines = [
        *front_matter(meta),
        f"# {Path(result.output_dir).name}: a drafter aligned to {target}",
        "",
        f"A draft model for speculative decoding with **{target}** as the target. It shares the "
        f"target's tokenizer, vocabulary size ({result.vocab_size}), special token ids and "
        "generation config, so engines accept the pair as is. Speculative decoding with it is "
        "lossless: the target verifies every drafted token.",
        "",
        *provenance(result),
        *_exported_rows(result),
        *_distillation(distill),
        *_measured(report),
        "",
        *vllm_section(result.vllm),
        *engine_section(engines),
        *gguf_section(getattr(result, "gguf", None), (report or {}).get("llamacpp")),
        *use_section(deploy, engines["source"]),
        *parallel_section(result, deploy.k),
        *self_check_section(result.check),
    ]
    return "\n".join(lines)
