"""Export of a drafter q with its own tokenizer (a mapped pair, TLI), and its self-check and card.

Target p, drafter q. A mapped drafter is served through the vocabulary intersection (vLLM
`use_heterogeneous_vocab`, `transformers` universal assisted generation), never as a drafter of
the target's ids, so unlike the shared-vocabulary export nothing is aligned to the target: the
weights keep their own rows, config and generation config, and the folder carries the
drafter's *own* tokenizer (what both engines read to build the mapping or re-tokenise text).

Self-check (on the temporary folder, before publishing): reload (config, dtype, tied head,
real-token logits unchanged), the saved tokenizer equals the drafter's, the intersection with
the target's tokenizer is not empty; then `generate(assistant_model=, tokenizer=,
assistant_tokenizer=)` (universal assisted generation, text-level) reproduces the target's
greedy output on every prompt (lossless in the engine users have), and the greedy TLI agreement
along the target's greedy continuation is recorded (the drafter reading the target's tokens
mapped, its argmax over the intersection mapped back: what vLLM's TLI drafts), and our decoder
with its mapped drafter (decode/drafters/mapped.py, TLI context) reproduces the target's greedy
output too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec, load_role
from specdistill.data.models.vocab_mapping import load_source, read_source, vocab_mapping
from specdistill.data.runtime import ConfigError
from specdistill.decode.universal_assisted import UpstreamFault, upstream_fault
from specdistill.distill.export.card import (
    card_metadata,
    front_matter,
    provenance,
    self_check_section,
    use_section,
    vllm_section,
)
from specdistill.distill.export.check import (
    ExportCheckError,
    _fail,
    assisted_equals_greedy,
    check_config,
    greedy,
    greedy_alpha_equal_to_target,
    logit_drift,
    pad_id,
)
from specdistill.distill.export.deploy import Deployment
from specdistill.distill.intersection import Intersection, served_argmax
from specdistill.distill.train.mapped import draft_unk_id, map_ids, read_ids

log = logging.getLogger("specdistill.export")


def drafter_tokenizer_folder(source: str, spec: PairSpec) -> Path:
    """Where the drafter's own tokenizer is read: the exported checkpoint's folder (distill's
    best/ saves it there), else the pair's drafter."""
    for name in (source, spec.drafter_tokenizer or spec.drafter):
        p = Path(str(name)).expanduser()
        if (p / "tokenizer.json").is_file():
            return p
    raise ConfigError(
        f"drafter={source!r} has no tokenizer.json and pair.drafter neither: a drafter with its "
        "own tokenizer is served through that tokenizer; save it beside the weights"
    )


def serving(deploy: Deployment, intersection: int) -> dict[str, Any]:
    """export.json's `mapped` section: how engines serve this drafter (its vLLM config is the
    deployment's: TLI through `use_heterogeneous_vocab`)."""
    return {
        "vocab": "mapped",
        "intersection": intersection,
        "vllm_speculative_config": deploy.vllm_speculative_config,
        "transformers": (
            "target.generate(**inputs, assistant_model=drafter, tokenizer=target_tokenizer, "
            "assistant_tokenizer=drafter_tokenizer)"
        ),
    }


def mapping_of(spec: PairSpec, folder: Path):
    """The vocabulary mapping between the target's tokenizer and the drafter's (files only);
    one `error:` line when they share no token."""
    t_src = load_source(spec.tokenizer, field="pair.tokenizer", revision=spec.revision)
    d_src = read_source(folder, str(folder))
    if t_src is None or d_src is None:
        raise ConfigError(f"drafter tokenizer {str(folder)!r}: no tokenizer.json to map from")
    mapping = vocab_mapping(t_src, d_src)
    if mapping.intersection_size == 0:
        raise ConfigError(
            f"the drafter's tokenizer {str(folder)!r} shares no token with pair.target's: "
            "it cannot be served through a vocabulary mapping"
        )
    return mapping


def self_check(
    folder: Path,
    spec: PairSpec,
    target_tok,
    draft_tok,
    *,
    prompts: list[str],
    max_new_tokens: int,
    device: torch.device,
    target_dtype: torch.dtype,
    expect_dtype: torch.dtype,
    min_positions: int | None,
    reference_logits: torch.Tensor,
    probe: torch.Tensor,
) -> dict[str, Any]:
    """Reload the mapped export and check it (module docstring); the findings for export.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    drafter = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    rows = int(drafter.get_output_embeddings().weight.shape[0])
    check_config(
        drafter.config, expect_vocab=rows, expect_dtype=expect_dtype, min_positions=min_positions
    )
    saved_tok = AutoTokenizer.from_pretrained(str(folder))
    if saved_tok.get_vocab() != draft_tok.get_vocab():
        _fail("the exported tokenizer is not the drafter's own")
    mapping = mapping_of(spec, folder)
    drift = logit_drift(drafter, probe, reference_logits)
    target = load_role(spec, "target", dtype=target_dtype, device=device)
    drafter = drafter.to(device)
    target_rows = max(len(target_tok), mapping.target_vocab)
    inter = Intersection.from_draft_to_target(
        mapping.resized(target_rows, max(rows, mapping.draft_vocab)).draft_to_target[:rows],
        target_rows,
    ).to(device)
    reads = read_ids(mapping, draft_unk_id(saved_tok), target_rows).to(device)
    same_tokens, agree, fault = 0, 0, None
    for text in prompts:
        ids, plain, fault = universal_equals_greedy(
            target, drafter, target_tok, saved_tok, text, max_new_tokens, device, fault
        )
        with torch.no_grad():
            full = torch.cat([ids, torch.tensor([plain], device=device)], 1)
            z = drafter(map_ids(full, reads)).logits[0, ids.shape[1] - 1 : -1].float()
        agree += int((served_argmax(z, inter) == torch.tensor(plain, device=device)).sum())
        same_tokens += len(plain)
    found: dict[str, Any] = {
        "reloaded": True,
        "tokenizer_is_the_drafters_own": True,
        "vocab": "mapped",
        "intersection": inter.size,
        **universal_finding(fault, len(prompts), same_tokens),
        "tli_greedy_agreement": round(agree / max(same_tokens, 1), 4),
        "max_logit_drift": drift,
        "max_position_embeddings": int(getattr(drafter.config, "max_position_embeddings", 0)),
        "min_positions": min_positions,
        "device": str(device),
    }
    found |= our_decoder_check(
        target, drafter, mapping, target_tok, saved_tok, prompts, max_new_tokens
    )
    return found


def universal_equals_greedy(
    target,
    drafter,
    target_tok,
    draft_tok,
    text: str,
    max_new_tokens: int,
    device: torch.device,
    fault: UpstreamFault | None,
) -> tuple[torch.Tensor, list[int], UpstreamFault | None]:
    """(prompt ids, the target's greedy output, transformers' own fault if any) on `text`:
    universal assisted generation must reproduce the target, unless it fails inside
    `transformers` (decode/universal_assisted.py). Then the target's plain output is taken, the
    fault is returned for export.json and the card, and `our_decoder_check` is what proves the
    drafter. Once it has failed, later prompts do not call it again."""
    if fault is None:
        try:
            ids, plain = assisted_equals_greedy(
                target, target_tok, text, max_new_tokens, device,
                "generate(assistant_model=drafter, assistant_tokenizer=...)",
                assistant_model=drafter, tokenizer=target_tok, assistant_tokenizer=draft_tok,
            )  # fmt: skip
            return ids, plain, None
        except ExportCheckError:
            raise
        except Exception as e:
            fault = upstream_fault(e)
            if fault is None:
                raise
            log.warning("export self-check: %s", fault.line())
    ids = torch.tensor([target_tok(text, add_special_tokens=False).input_ids], device=device)
    with torch.no_grad():
        plain = greedy(target, ids, max_new_tokens, pad_id(target_tok))
    return ids, plain, fault


def universal_finding(fault: UpstreamFault | None, prompts: int, tokens: int) -> dict[str, Any]:
    """export.json's record of the universal assisted check: equal on every prompt, or the
    installed `transformers`' own fault in one line."""
    if fault is None:
        return {"universal_assisted_equals_target_greedy": f"{prompts} prompts, {tokens} tokens"}
    return {"universal_assisted_fault": fault.line(), "transformers": fault.version}


def our_decoder_check(
    target, drafter, mapping, target_tok, draft_tok, prompts: list[str], max_new_tokens: int
) -> dict[str, Any]:
    """Our decoder with the mapped drafter (decode/drafters/mapped.py, TLI context, greedy,
    gamma 4) reproduces the target's greedy output on every prompt; its acceptance recorded."""
    from specdistill.decode.drafters.mapped import make_mapped_vocab
    from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder

    t_rows = int(target.get_output_embeddings().weight.shape[0])
    d_rows = int(drafter.get_output_embeddings().weight.shape[0])
    mv = make_mapped_vocab(mapping, t_rows, d_rows, draft_tokenizer=draft_tok)
    eos = () if target_tok.eos_token_id is None else (int(target_tok.eos_token_id),)
    cfg = DecoderConfig(gamma=4, max_new_tokens=max_new_tokens, eos_token_id=eos)
    dec = SpeculativeDecoder(target, drafter, cfg, tokenizer_len=len(target_tok), mapped=mv)
    alpha = greedy_alpha_equal_to_target(
        dec, target, target_tok, prompts, max_new_tokens,
        lambda text, got, plain: "our decoder with the mapped drafter diverged from the target "
        f"on {text[:40]!r}",
    )  # fmt: skip
    return {
        "our_decoder_tli_equals_target_greedy": f"{len(prompts)} prompts, gamma 4",
        "our_decoder_tli_alpha_greedy": alpha,
    }


def mapped_card(
    result: Any,
    distill: dict[str, Any] | None,
    deploy: Deployment,
    k_source: str,
    license: str | None = None,
) -> str:
    """README.md for a mapped export: what it is, how to serve it, the self-check."""
    target, out = result.target, result.output_dir
    data = (distill or {}).get("data") or {}
    held = ""
    if distill:
        mode = "greedy" if (data.get("eval_sampling") or {}).get("temperature") == 0 else "T=1"
        held = (
            f"- held-out TLI acceptance ({mode}, through the mapping, on "
            f"{data.get('eval_source')} completions, {data.get('eval_tokens')} tokens): "
            f"{distill.get('alpha_before'):.3f} before distillation, "
            f"{distill.get('best_alpha'):.3f} best (step {distill.get('best_step')})"
        )
    meta = card_metadata(
        target=deploy.target,
        base_drafter=result.base_drafter,
        k=deploy.k,
        vocab=deploy.vocab,
        license=license,
        extra_tags=("heterogeneous-vocabulary",),
    )
    lines = [
        *front_matter(meta),
        f"# {Path(out).name}: a drafter with its own tokenizer, aligned to {target}",
        "",
        f"A draft model for speculative decoding with **{target}** as the target. It keeps its "
        f"own tokenizer ({result.source_vocab_size} rows): engines serve it through the "
        f"vocabulary intersection ({result.mapped['intersection']} tokens spelled the same), "
        "TLI in vLLM (the drafter reads the target's tokens mapped to its ids, drafts over the "
        "intersection; greedy drafts) or text re-tokenisation in `transformers` (universal "
        "assisted generation). Lossless either way: the target verifies every drafted token.",
        "",
        *provenance(result),
        *([held] if held else []),
        "",
        *use_section(deploy, k_source),
        *(
            [f"Not with every release: {result.check['universal_assisted_fault']}.", ""]
            if result.check.get("universal_assisted_fault")
            else []
        ),
        *self_check_section(result.check),
        *vllm_section(result.vllm),  # vllm.enabled: this folder served by vLLM as TLI
    ]
    return "\n".join(lines)
