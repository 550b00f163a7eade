"""The recommended K: the draft length that maximises the cost model's speedup, from our
decoder's acceptance by position, priced at this machine's costs and at each of a user's
(`cost_model`). Export writes it into the drafter as the engines' setting. p = target, q = drafter.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from specdistill.decode.draft_length import recommend_k, speedup_table
from specdistill.decode.validate.engines.ours import ServingMeasurement
from specdistill.decode.validate.loaded import Setup
from specdistill.decode.validate.modes import merge, run_all
from specdistill.decode.validate.settings import CostModel, ValidateSettings

log = logging.getLogger(__name__)


def recommendation(
    vs: ValidateSettings, st: Setup, sv: ServingMeasurement, machine: str
) -> dict[str, Any] | None:
    """The K that maximises the cost model's speedup, from acceptance by position up to
    `recommend_max_k` (the headline's decode when its K reaches that far, else one untimed
    decode at that K: acceptance at a position barely depends on the drafts after it), priced
    at this machine's costs and at each of `cost_model`'s."""
    top = vs.recommend_max_k
    if not top:
        return None
    accept, source = sv.figures["acceptance_by_position"], f"the serving decode (K={sv.gamma})"
    if top > len(accept):
        log.info("validate: acceptance by position up to K=%d for the recommended K", top)
        probe = sv.make(top, vs.decoder.replace(draft_length="fixed", lookup=False))
        _, outs = run_all(probe.generate, st.batches, vs.seed)
        accept, source = merge(outs).acceptance_at(), f"an untimed decode at K={top}"
    accept = accept[:top]
    entries = [CostModel(f"this machine ({machine})", vs.batch_size, sv.costs), *vs.cost_model]
    out = []
    for e in entries:
        costs = dataclasses.replace(e.costs, parallel=sv.dec.parallel)
        k, speed = recommend_k(accept, costs)
        out.append(
            {
                "label": e.label,
                "batch": e.batch,
                "c": round(costs.c, 4),
                "verify_per_token": round(costs.verify_per_token, 4),
                "k": k,
                "speedup": round(speed, 3),
                "pays": speed > 1.0,  # False: no K beats target-only decoding at these costs
                "speedup_by_k": speedup_table(accept, costs),
            }
        )
    return {"max_k": top, "acceptance_by_position": accept, "source": source, "by_cost": out}
