"""Validate's side of a mapped pair (the drafter q has its own tokenizer; decode/drafters/mapped.py).

p = target, q = drafter. `load_mapped` builds the decoder's `MappedVocab`; `mapping_figures`
reports the intersection and the coverage: the share of the target's own greedy output tokens
that q can propose at all, an upper bound on greedy alpha. With vLLM the pair runs as TLI
(decode/validate/engines/vllm.py compares vLLM's own mapping with ours).
"""

from __future__ import annotations

from typing import Any

from specdistill.data.models.pair_vocab import pair_mapping
from specdistill.data.models.pairs import load_drafter_tokenizer, vocab_size
from specdistill.decode.config import DecoderConfig
from specdistill.decode.drafters.mapped import MappedVocab, check_context, make_mapped_vocab


def mapped_context(cfg: Any) -> str:
    """`decoder.mapped_context` (absent: the decoder's default, conf/decoder/greedy.yaml's),
    checked before anything loads."""
    return check_context(cfg.decoder.get("mapped_context", DecoderConfig.mapped_context))


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
