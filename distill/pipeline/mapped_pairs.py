"""What a pipeline over a mapped pair can run (a drafter q with its own tokenizer).

The stages resolve the pair themselves and refuse what they cannot run for a mapped pair, but
generate runs first and costs minutes on the real pair: so the plan checks the same rules up
front, on the configs the stages will get, and a hopeless run is one `error:` line before any
step starts. Generate, distill (lmbda 0, autoregressive), validate and export run mapped pairs
(`vllm=true` too: the export validates the folder in vLLM as TLI, `use_heterogeneous_vocab`);
online adaptation (its batches are drafter-generated, in the drafter's tokens) does not yet.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from specdistill.data.models.pair_vocab import resolves_to_mapped
from specdistill.data.runtime import ConfigError
from specdistill.distill.train.mapped import check_mapped_config
from specdistill.distill.train.settings import TrainSettings


def check_mapped_plan(pair: Any, steps: list[Any]) -> None:
    """One `error:` line where a step of the plan (`steps`: its Steps, each a stage and its
    final config) cannot run the mapped pair; nothing for a shared pair."""
    if not resolves_to_mapped(pair):
        return
    for step in steps:
        if step.stage == "online":
            raise ConfigError(
                "stages include online, but online adaptation of a drafter with its own "
                "tokenizer (pair.vocab=mapped) is not supported yet (online updates have no "
                "vocabulary-mapped path): drop online from stages"
            )
        if step.stage == "distill":
            # lmbda, drafting, draft_vocab_train: distill's own lines, on distill's own settings
            check_mapped_config(TrainSettings.from_cfg(OmegaConf.create(step.config)))
