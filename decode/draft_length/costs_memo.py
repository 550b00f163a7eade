"""Measured draft costs shared by the decoders of one run over the same models and prompt.

p = target, q = drafter. Validate builds several decoders over one loaded pair (a gamma=auto
pilot, the serving mode's, the other serving mode's), and each measured its own `DraftCosts`
at first use (`measure_costs`): on a real pair on a CPU three by-width measurements were most of
validate's untimed time. What a measurement times splits in two:

- the forwards (a target step, the drafter's steps, verifies of 1..max_draft drafts): pure model
  work, the same whatever the serving mode: keyed by the models, the prompt, the widths and the
  decoder's step settings (cache, compiled steps, CPU linears, draft head, drafting mode);
- the round's host-side glue (`round_glue`: sampling and testing drafts, bookkeeping): it
  changes with the serving mode, so it is keyed by those settings as well.

A decoder whose settings differ only in what a round drafts (gamma, the draft-length policy, its
floor) or how long a decode runs gets the whole measurement; one in the other serving mode gets
the forwards and times its own glue. Settings not named below count as timed (a new one is never
shared by mistake).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from specdistill.data.sampling import Sampling

# what a round drafts and how a decode ends: no measured step sees them (the glue's decodes are
# fixed-length, `max_draft` is keyed on its own and prompt lookup is off in them)
_NOT_TIMED: dict[str, Any] = {
    "gamma": 1,
    "max_new_tokens": 1,
    "eos_token_id": (),
    "draft_length": "fixed",
    "draft_floor": False,
    "probe_every": 1,
    "lookup": False,
    "draft_costs": None,
}
# what only the round's glue sees: the serving mode and a round's host-side bookkeeping
_GLUE_ONLY: dict[str, Any] = {
    "sampling": Sampling(),
    "lenience": 1.0,
    "record_probs": False,
    "host_sync_every": 0,
    "draft_scope": "batch",
}


class ForwardTimings(NamedTuple):
    """A measurement's forwards: median ratio to the target step per timed forward (`d`: one
    draft, `dk`: a parallel drafter's k masks, `v{j}`: a verify of j drafts) and the median
    seconds of a target step (the unit of the glue)."""

    ratios: dict[str, float]
    step_seconds: float


def _key(dec, ids: torch.Tensor, iters: int, neutral: dict[str, Any]) -> tuple:
    cfg = dataclasses.replace(dec.cfg, **neutral)
    return (
        id(dec.target),
        id(dec.drafter),
        id(dec.mapped),
        dec.max_draft,
        tuple(dec.verify_widths),
        iters,
        repr(cfg),
        str(ids.device),
        tuple(ids.shape),
        ids.detach().cpu().numpy().tobytes(),
    )


class CostsMemo:
    """Forward timings and whole `DraftCosts` by what they time (module docstring). Entries keep
    their models alive, so an id in a key is never reused by another model. `forward_hits` and
    `cost_hits` count reuses (reports and tests)."""

    def __init__(self) -> None:
        self._forwards: dict[tuple, tuple[Any, ForwardTimings]] = {}
        self._costs: dict[tuple, tuple[Any, Any]] = {}
        self.forward_hits = 0
        self.cost_hits = 0

    def forwards(self, dec, ids: torch.Tensor, iters: int) -> ForwardTimings | None:
        got = self._forwards.get(_key(dec, ids, iters, _NOT_TIMED | _GLUE_ONLY))
        self.forward_hits += got is not None
        return None if got is None else got[1]

    def keep_forwards(self, dec, ids: torch.Tensor, iters: int, timings: ForwardTimings) -> None:
        key = _key(dec, ids, iters, _NOT_TIMED | _GLUE_ONLY)
        self._forwards[key] = ((dec.target, dec.drafter, dec.mapped), timings)

    def costs(self, dec, ids: torch.Tensor, iters: int):
        got = self._costs.get(_key(dec, ids, iters, _NOT_TIMED))
        self.cost_hits += got is not None
        return None if got is None else got[1]

    def keep_costs(self, dec, ids: torch.Tensor, iters: int, costs) -> None:
        self._costs[_key(dec, ids, iters, _NOT_TIMED)] = ((dec.target, dec.drafter), costs)
