"""Validate's side of a mapped pair (the drafter q has its own tokenizer; decode/drafters/mapped.py).

p = target, q = drafter. `load_mapped` builds the decoder's `MappedVocab` from the resolved pair
(the mapping cached per pair, `decoder.mapped_context`); `mapping_figures` reports the
intersection and the coverage beside alpha, tau and c: the share of the target's own greedy
output tokens (the reference decode) that q can propose at all, an upper bound on greedy alpha.
"""

from __future__ import annotations

from typing import Any

from specdistill.data.models.pair_vocab import pair_mapping
from specdistill.data.models.pairs import load_drafter_tokenizer, vocab_size
from specdistill.data.runtime import ConfigError
from specdistill.decode.drafters.mapped import MappedVocab, check_context, make_mapped_vocab


def mapped_context(cfg: Any) -> str:
    """`decoder.mapped_context` (tli when absent), checked before anything loads."""
    return check_context(cfg.decoder.get("mapped_context", "tli"))


def check_mapped_stage(cfg: Any, spec: Any, engines: tuple[str, ...]) -> None:
    """Settings validate cannot honour for a mapped pair, one line each (before loading)."""
    if spec.vocab != "mapped":
        return
    mapped_context(cfg)
    if "vllm" in engines:
        raise ConfigError(
            "engines=[ours,vllm] with a mapped pair (the drafter has its own tokenizer): running "
            "it in vLLM (use_heterogeneous_vocab) from validate is not wired yet; use engines=[ours]"
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
