"""Drafting strategies behind one interface (`base.Drafter`), by `decoder.drafting`.

p = target, q = drafter. `autoregressive`: k 1-token drafter steps per round; `parallel`: one
drafter forward over k-1 mask tokens (PARD). A mapped-vocabulary drafter (another tokenizer)
is a third `Drafter` mapping ids in (`drafter_ids`) and q out (`target_logits`).
"""

from specdistill.decode.drafters.autoregressive import AutoregressiveDrafter
from specdistill.decode.drafters.base import Drafter, Proposal
from specdistill.decode.drafters.parallel import ParallelDrafter, resolve_mask_token

DRAFTERS: dict[str, type[Drafter]] = {
    "autoregressive": AutoregressiveDrafter,
    "parallel": ParallelDrafter,
}
DRAFTING = tuple(DRAFTERS)

__all__ = [
    "DRAFTERS",
    "DRAFTING",
    "AutoregressiveDrafter",
    "Drafter",
    "ParallelDrafter",
    "Proposal",
    "resolve_mask_token",
]
