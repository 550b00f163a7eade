"""A drafter q with its own tokenizer, decoded against the target p through a vocabulary mapping.

p = target, q = drafter. The round loop speaks the target's ids only; this drafter maps ids in
(`drafter_ids`) and its distribution out (`target_logits`). Two context modes
(`decoder.mapped_context`): `tli` (vLLM's `use_heterogeneous_vocab`): the drafter reads the
target's tokens mapped to its ids, a token outside the intersection as its unk (else eos) id,
vLLM's rule, so each drafter slot stays one target token and the autoregressive strategy runs
unchanged; `text` (`transformers`' universal assisted generation): the drafter reads the
target's text re-tokenized (`text_context.py`).

In both, q is the drafter's softmax over the rows that map, its mass scatter-added into the
target's ids (several drafter ids may spell one target token). The sampling spec then applies
to q over the target's ids exactly as to p, and q depends only on the context and the round's
earlier drafts, so the acceptance rule stays exact: lossless in both modes. Target tokens
outside the intersection get q = 0 and come only from the residual or p's own next token.

Unsupported with a mapping: `drafting=parallel` (its mask token is an id of a drafter trained on
the target's ids) and `lenience` < 1 (a lossy rule over such a q is not DistillSpec's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.models.vocab_mapping import VocabMapping
from specdistill.data.runtime import ConfigError
from specdistill.decode.drafters.autoregressive import AutoregressiveDrafter

CONTEXTS = ("tli", "text")


@dataclass(frozen=True)
class MappedVocab:
    """What a mapped drafter needs: the mapping at the models' logit rows, the drafter's id for
    target tokens it lacks, the context mode and (text mode) both tokenizers."""

    mapping: VocabMapping
    draft_unk: int
    context: str = "tli"
    target_tokenizer: Any = None
    draft_tokenizer: Any = None

    @property
    def figures(self) -> dict[str, Any]:
        """The mapping's figures for reports."""
        m = self.mapping
        return {
            "context": self.context,
            "intersection": m.intersection_size,
            "target_mapped": m.target_mapped,
            "target_vocab": m.target_vocab,
            "draft_vocab": m.draft_vocab,
            "draft_unk": self.draft_unk,
        }


def check_context(value: Any) -> str:
    """`decoder.mapped_context`, checked (one line naming the field)."""
    v = "tli" if value is None else str(value)
    if v not in CONTEXTS:
        raise ConfigError(
            f"decoder.mapped_context={value!r}: use tli (the drafter reads the target's tokens "
            "mapped to its ids, what vLLM serves) or text (the target's text re-tokenized by the "
            "drafter's tokenizer, what transformers' universal assisted generation does)"
        )
    return v


def draft_unk_id(draft_tokenizer: Any) -> int:
    """The drafter's id for a target token it lacks: unk, else eos (vLLM's rule), else error."""
    for role in ("unk_token_id", "eos_token_id"):
        v = getattr(draft_tokenizer, role, None)
        if isinstance(v, int):
            return v
    raise ConfigError(
        "pair.drafter's tokenizer has neither an unk nor an eos token: a mapped drafter needs "
        "one to read target tokens outside the shared vocabulary; add one and save it"
    )


def make_mapped_vocab(
    mapping: VocabMapping,
    target_rows: int,
    draft_rows: int,
    *,
    draft_tokenizer: Any,
    target_tokenizer: Any = None,
    context: Any = "tli",
) -> MappedVocab:
    """A `MappedVocab` with the mapping padded to the models' logit rows; checks that q can
    propose at least one token and that text mode has both tokenizers."""
    ctx = check_context(context)
    m = mapping.resized(target_rows, draft_rows)
    if m.intersection_size == 0:
        raise ConfigError(
            "pair.drafter shares no token with pair.target: a mapped drafter could never "
            "propose one; choose a drafter whose tokenizer overlaps the target's"
        )
    if ctx == "text" and (target_tokenizer is None or draft_tokenizer is None):
        raise ValueError("decoder.mapped_context=text needs both tokenizers")
    return MappedVocab(m, draft_unk_id(draft_tokenizer), ctx, target_tokenizer, draft_tokenizer)


def restricted_target_logprobs(
    logits: torch.Tensor, allowed: torch.Tensor, index: torch.Tensor, vocab: int
) -> torch.Tensor:
    """log q over the target's `vocab` ids from drafter logits (..., Vd): rows outside `allowed`
    set to -inf, softmax, scatter-add into the target ids `index` (Vd,), log (0 -> -inf).
    Pure; q sums to 1 over the target ids."""
    x = logits.float().masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(x, -1)
    out = probs.new_zeros(*probs.shape[:-1], vocab)
    out.scatter_add_(-1, index.expand(probs.shape), probs)
    return out.log()


class MappedDrafter(AutoregressiveDrafter):
    """`tli` context: autoregressive drafting through the mapping (see the module docstring)."""

    def __init__(self, model, *, mapped: MappedVocab, **kw: Any) -> None:
        super().__init__(model, **kw)
        dev = kw["device"]
        m = mapped.mapping
        self.mapped = mapped
        self.t2d = m.target_to_draft.to(dev)
        self.t2d = torch.where(self.t2d >= 0, self.t2d, torch.full_like(self.t2d, mapped.draft_unk))
        self.allowed = (m.draft_to_target >= 0).to(dev)
        self.index = m.draft_to_target.clamp(min=0).to(dev)  # masked rows add 0 mass anywhere

    def drafter_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's ids as the drafter's (outside the intersection: its unk, or eos)."""
        return self.t2d[ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """log q over the target's ids: restricted to the intersection, scatter-added."""
        return restricted_target_logprobs(logits, self.allowed, self.index, self.vocab)


def check_mapped_decoding(cfg: Any) -> None:
    """Decoder settings a mapped drafter cannot honour, refused in one line with the reason."""
    if cfg.drafting != "autoregressive":
        raise ConfigError(
            f"decoder.drafting={cfg.drafting!r} with a mapped drafter (its own tokenizer): "
            "parallel drafting reads a mask token of a drafter trained on the target's ids; "
            "use decoder.drafting=autoregressive"
        )
    if cfg.lenience != 1.0:
        raise ConfigError(
            f"decoder.lenience={cfg.lenience} with a mapped drafter: q is 0 outside the shared "
            "vocabulary, so the lenient rule is not DistillSpec's; use lenience=1"
        )


def check_mapped_pair(target, drafter, mapped: MappedVocab) -> int:
    """Same device and dtype, and the mapping sized to both models' logit rows; returns the
    target's vocabulary size (q is moved into it)."""
    t_param, d_param = next(target.parameters()), next(drafter.parameters())
    if t_param.device != d_param.device or t_param.dtype != d_param.dtype:
        raise ConfigError(
            f"pair.drafter is {d_param.dtype} on {d_param.device} but pair.target is "
            f"{t_param.dtype} on {t_param.device}: load both alike (the `dtype`, `device` settings)"
        )
    tv = int(target.get_output_embeddings().weight.shape[0])
    dv = int(drafter.get_output_embeddings().weight.shape[0])
    m = mapped.mapping
    if (m.target_vocab, m.draft_vocab) != (tv, dv):
        raise ConfigError(
            f"the vocabulary mapping is for {m.target_vocab} target and {m.draft_vocab} drafter "
            f"logit rows, but pair.target has {tv} and pair.drafter {dv}: build it with "
            "make_mapped_vocab(mapping, target_rows, draft_rows)"
        )
    return tv
