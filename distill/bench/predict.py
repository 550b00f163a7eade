"""The distill stage's held-out decode prediction for an existing drafter, without training.

    python -m specdistill.distill.bench.predict pair=toy [pair.drafter=PATH] output_dir=OUT \\
        [eval.limit=32 eval.max_new_tokens=48 eval.predict.gamma=4]

Runs `distill.train.stage.prepare` (the target's greedy continuations of the eval split; no
Seq-KD data: the reference completions stand in as training rows, nothing is trained) and
`distill.train.predict.heldout_prediction` on the drafter as it is. Prints and writes
OUT/prediction.json: fixed gamma and the adaptive draft-length policies replayed over the
held-out agreement strings, priced with `eval.predict.costs` (else the cost model's defaults,
labelled uncalibrated: nothing is timed).
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import atomic_write_json
from specdistill.data.runtime import ConfigError, run_or_exit
from specdistill.distill.train import stage
from specdistill.distill.train.predict import heldout_prediction

FORCED = {
    "eval": {"source": "target", "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}},
    "data": {"seq_kd": False, "reference": True},
    "logger": {"name": "none"},
}


def run(cfg: DictConfig) -> dict:
    cfg = OmegaConf.merge(cfg, FORCED)
    tr = stage.prepare(cfg)
    if not tr.objective.predicts_decode:
        raise ConfigError(
            "the decode prediction replays autoregressive drafts in the target's ids: use "
            "drafting=autoregressive with a drafter of the target's tokenizer"
        )
    pred = heldout_prediction(tr, tr.accelerator.unwrap_model(tr.model), tr.s)
    assert pred is not None  # greedy serving is forced above
    atomic_write_json(tr.out / "prediction.json", pred)
    return pred


@hydra.main(config_path="pkg://specdistill.conf", config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(json.dumps(run_or_exit(run, cfg), indent=1))


if __name__ == "__main__":
    main()
