"""Validate's side of a mapped pair (the drafter q has its own tokenizer; decode/drafters/mapped.py).

p = target, q = drafter. `load_mapped` builds the decoder's `MappedVocab`; `mapping_figures`
reports the intersection and the coverage: the share of the target's own greedy output tokens
that q can propose at all, an upper bound on greedy alpha. With vLLM the pair runs as TLI.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.data.models.pair_vocab import pair_mapping
from specdistill.data.models.pairs import load_drafter_tokenizer, vocab_size
from specdistill.data.runtime import ConfigError
from specdistill.decode.drafters.mapped import MappedVocab, check_context, make_mapped_vocab


def mapped_context(cfg: Any) -> str:
    """`decoder.mapped_context` (tli when absent), checked before anything loads."""
    return check_context(cfg.decoder.get("mapped_context", "tli"))


def check_mapped_stage(cfg: Any, spec: Any, engines: tuple[str, ...]) -> None:
    """Settings validate cannot honour for a mapped pair, one line each (before loading).

    vLLM's TLI drafts greedily and reads the target's tokens mapped to the drafter's ids, so
    draft sampling must stay greedy and ours must run `tli`, or the engines would measure
    different drafters."""
    if spec.vocab != "mapped":
        return
    context = mapped_context(cfg)
    if "vllm" not in engines:
        return
    method = (cfg.get("vllm") or {}).get("draft_sample_method")
    if method not in (None, "greedy"):
        raise ConfigError(
            f"vllm.draft_sample_method={method!r} with a mapped pair (the drafter has its own "
            "tokenizer): vLLM's use_heterogeneous_vocab drafts greedily only; set it to null"
        )
    if context != "tli":
        raise ConfigError(
            f"decoder.mapped_context={context} with engines=[ours,vllm]: vLLM serves a drafter "
            "with its own tokenizer as TLI only, so both engines' acceptance is comparable with "
            "decoder.mapped_context=tli; use it, or engines=[ours]"
        )


def load_mapped(cfg: Any, spec: Any, target, drafter, tok) -> MappedVocab | None:
    """The decoder's mapping for a mapped pair (None for a shared one)."""
    if spec.vocab != "mapped":
        return None
    return make_mapped_vocab(
        pair_mapping(spec),
        vocab_size(target),
        vocab_size(drafter),
        draft_tokenizer=load_drafter_tokenizer(spec),
        target_tokenizer=tok,
        context=mapped_context(cfg),
    )


def mapping_figures(mapped: MappedVocab | None, reference: list[list[int]]) -> dict | None:
    """The mapping's figures and its coverage of the target's own output tokens."""
    if mapped is None:
        return None
    t2d = mapped.mapping.target_to_draft
    toks = [t for row in reference for t in row]
    covered = sum(1 for t in toks if t < t2d.numel() and int(t2d[t]) >= 0)
    return mapped.figures | {
        "output_tokens": len(toks),
        "output_coverage": round(covered / max(len(toks), 1), 4),
    }


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
