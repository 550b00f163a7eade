"""The two parts of a distill run, chosen once: what the drafter is trained against
(train/objective.py: shared vocabulary, mapped vocabulary, parallel drafting) and how it is
spread over processes (train/spread.py: one process or DDP, ZeRO-2/3, FSDP2).

`choose_parts` is the one place a training mode is decided; `prepare` (train/trainer.py) calls
it once, and the loop (train/step.py, train/progress.py, train/result.py) calls the parts
without asking which they are. Which combinations may run is checked before this, from the
settings alone (`TrainSettings.from_cfg`, `setup.check_settings`): FSDP2 takes neither a mapped
nor a parallel drafter, a mapped pair no parallel drafting.
"""

from __future__ import annotations

from typing import NamedTuple

from specdistill.distill.train.fsdp import FSDP2
from specdistill.distill.train.mapped_vocab import MappedVocab
from specdistill.distill.train.objective import Objective
from specdistill.distill.train.parallel_drafting import ParallelDrafting
from specdistill.distill.train.replicated import Replicated
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import SharedVocab
from specdistill.distill.train.spread import Spread
from specdistill.distill.train.zero import ZeRO


class Parts(NamedTuple):
    objective: Objective
    spread: Spread


def choose_parts(s: TrainSettings, vocab: str) -> Parts:
    """The run's objective and spread from its settings and the pair's resolved vocabulary
    (`vocab`: `PairSpec.vocab`, "mapped" for a drafter with its own tokenizer)."""
    objective: Objective
    if vocab == "mapped":
        objective = MappedVocab(s)
    elif s.parallel is not None:
        objective = ParallelDrafting(s)
    else:
        objective = SharedVocab(s)
    spread: Spread
    if s.deepspeed:
        spread = ZeRO(s.zero_stage)
    elif s.fsdp:
        spread = FSDP2()
    else:
        spread = Replicated()
    return Parts(objective, spread)
