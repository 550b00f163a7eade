"""Parallel drafting (PARD): one drafter forward proposes all k drafts of a round.

p = target, q = drafter. A parallel drafter reads a context followed by k-1 mask tokens and
predicts the next k tokens at once (`specdistill.distill.parallel`), so a round costs one drafter
forward whatever k: it reads the tokens accepted since its last forward plus the masks, and
draft i is drawn from q_i alone. The masks' slots are then rolled back, so the drafter's cache
holds real tokens only (the accepted drafts are fed at the start of the next forward).

Lossless: q_i depends on the context before the round only, never on d_1..d_{i-1}; it is still a
distribution over position i given the prefix, which is all the acceptance rule needs.
"""

from __future__ import annotations

import torch

from specdistill.data.runtime import ConfigError
from specdistill.decode.draft_length.costs import chunk_widths
from specdistill.decode.drafters.base import Drafter, KeepDrafting, Proposal


def resolve_mask_token(drafter, configured: int | None, vocab: int) -> int:
    """The mask token id: configured, else the drafter's `config.mask_token_id` (exported
    parallel drafters carry it); must be an id of the shared vocabulary."""
    mask_id = configured
    if mask_id is None:
        mask_id = getattr(getattr(drafter, "config", None), "mask_token_id", None)
    if mask_id is None:
        raise ConfigError(
            "decoder.drafting=parallel needs a mask token: set decoder.mask_token_id or use a "
            "drafter whose config.json has mask_token_id (a parallel-distilled drafter)"
        )
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
        raise ConfigError(f"decoder.mask_token_id={mask_id!r} must be a token id in 0..{vocab - 1}")
    return mask_id


def trained_depth(drafter) -> int | None:
    """Drafts a round the parallel drafter was trained to propose (`parallel_drafting.max_drafts`
    in its config.json, as distill writes it and vLLM reads it); None when it does not say."""
    spec = getattr(getattr(drafter, "config", None), "parallel_drafting", None)
    depth = spec.get("max_drafts") if isinstance(spec, dict) else None
    return depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else None


class ParallelDrafter(Drafter):
    """One forward over [lag, t, k-1 masks] per round (`decoder.drafting=parallel`)."""

    parallel = True

    def __init__(self, model, *, mask_token_id: int | None = None, **kw) -> None:
        super().__init__(model, **kw)
        self.mask_token_id = resolve_mask_token(model, mask_token_id, self.vocab)

    @property
    def reserved_ids(self) -> set[int]:
        return {self.mask_token_id}

    def start(self, ids, prompt_mask, mask, dense, slots, cut: int = 0) -> None:
        super().start(ids, prompt_mask, mask, dense, slots, cut)
        # tokens the drafter has not read yet (the accepted drafts of the last round and the
        # tokens of prompt-lookup rounds) and their positions
        self.lag = ids.new_zeros(ids.shape[0], 0)
        self.lag_pos = self.lag.clone()

    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
    ) -> Proposal:
        """All k proposals from one forward; the masks' slots are dropped from the cache before
        returning. Confidences (when asked) let the policy pick how many to verify."""
        b = t.shape[0]
        lag, lag_pos = self._feed_excess(self.lag, self.lag_pos)
        masks = torch.full((b, k - 1), self.mask_token_id, dtype=t.dtype, device=t.device)
        x = torch.cat([lag, t[:, None], masks], 1)
        keep_from = self.runner.length + lag.shape[1] + 1  # slots from here on are masks
        xpos = None
        if not self.dense:
            xpos = torch.cat([lag_pos, pos[:, None] + torch.arange(k, device=self.device)], 1)
        logits = self._forward(x, xpos, keep=k)
        self.runner.rollback(keep_from)
        want_q = keep_drafting is not None
        drafts, q = self._draw(logits, generator, want_q)
        return Proposal(
            tokens=drafts,
            q=None if self.sampling.greedy else q,
            conf=q.max(-1).values.tolist() if want_q else None,
            forwards=1,
        )

    def _feed_excess(self, lag: torch.Tensor, lag_pos: torch.Tensor):
        """Compiled drafter steps see a few shapes (warmed up: lag 0..max_draft): a longer lag,
        left by prompt-lookup rounds, is fed first in power-of-two chunks."""
        excess = lag.shape[1] - self.max_draft
        if excess <= 0 or not self._chunked:
            return lag, lag_pos
        return self._feed(lag, lag_pos, chunk_widths(excess))

    def skip(self, t: torch.Tensor, pos: torch.Tensor) -> None:
        self.lag = torch.cat([self.lag, t[:, None]], 1)
        self.lag_pos = torch.cat([self.lag_pos, pos[:, None]], 1)

    def accept(
        self, drafts: torch.Tensor, accepted: int, new_length: int, pos: torch.Tensor
    ) -> None:
        """The cache holds t (the masks are gone): the accepted drafts are next round's lag."""
        self.lag = drafts[:, :accepted]
        self.lag_pos = pos[:, None] + 1 + torch.arange(accepted, device=self.device)

    def warm_shapes(self) -> tuple[tuple[int, int], ...]:
        """One forward over lag + t + gamma-1 masks, lag 0..gamma."""
        g = self.max_draft
        return tuple((g + lag, g) for lag in range(g + 1))
