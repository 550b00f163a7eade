"""Drafting strategies behind one interface (`base.Drafter`), by `decoder.drafting`.

p = target, q = drafter. `autoregressive`: k 1-token drafter steps per round; `parallel`: one
drafter forward over k-1 mask tokens (PARD). A mapped-vocabulary drafter (another tokenizer)
is a third `Drafter` mapping ids in (`drafter_ids`) and q out (`target_logits`): `mapped.py`
(`tli` context) and `text_context.py` (`text` context), built by `mapped_drafter`.
"""

from typing import Any

from specdistill.decode.drafters.autoregressive import AutoregressiveDrafter
from specdistill.decode.drafters.base import Drafter, Proposal
from specdistill.decode.drafters.mapped import MappedDrafter, MappedVocab
from specdistill.decode.drafters.parallel import ParallelDrafter, resolve_mask_token
from specdistill.decode.drafters.text_context import TextContextDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "autoregressive": AutoregressiveDrafter,
    "parallel": ParallelDrafter,
}
DRAFTING = tuple(DRAFTERS)


def mapped_drafter(mapped: MappedVocab, model, **kw: Any) -> MappedDrafter:
    """The mapped drafter q for `mapped.context` (tli or text); kw as for `DRAFTERS`."""
    cls = TextContextDrafter if mapped.context == "text" else MappedDrafter
    return cls(model, mapped=mapped, **kw)


__all__ = [
    "DRAFTERS",
    "DRAFTING",
    "AutoregressiveDrafter",
    "Drafter",
    "MappedDrafter",
    "MappedVocab",
    "ParallelDrafter",
    "Proposal",
    "TextContextDrafter",
    "mapped_drafter",
    "resolve_mask_token",
]
