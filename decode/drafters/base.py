"""`Drafter`: the one small interface through which the round loop drives any kind of drafter q.

p = target, q = drafter, k = drafts per round. `SpeculativeDecoder.generate` is the only round
loop; what differs between kinds of drafter (autoregressive, parallel mask tokens, another
tokenizer) lives behind `start`, `propose`, `skip` (a prompt-lookup round the drafter did not
read), `accept` (keep the accepted prefix, roll back the rest) and `warm_shapes`. The loop speaks
the target's ids only: `drafter_ids` / `target_logits` map ids in and logits out.

Both caches share one slot layout (`specdistill.decode.cache`), so the loop's 2-D mask serves
both; a drafter that reads only the end of the prompt (`decoder.drafter_context`) skips the first
`cut` slots: its slot i is the target's slot i + cut.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.data.models.pairs import match_vocab
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import greedy_tokens, probs_from_logits, sample_from, uniforms
from specdistill.decode.cache import ModelRunner, prefill_prompt, step_mask

# keep_drafting(tops): a draft whose q has top probability tops[r] in row r was drawn: keep it
# and draft on? (a draft-length policy's stopping rule; reads q only, so it stays lossless)
KeepDrafting = Callable[[list[float]], bool]


@dataclass
class Proposal:
    """A round's drafts: tokens (B, k) in the target's ids (k may be 0 when a stopping rule
    kept none); q (B, k, V) the drafter's distributions over the target's vocabulary they were
    sampled from (None when greedy); conf[r][j] q's top probability at row r's draft j (only
    when asked for); forwards: drafter forwards spent."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    conf: list[list[float]] | None
    forwards: int


class Drafter(ABC):
    """A drafting strategy over one drafter model q (see the module docstring)."""

    parallel = False  # one forward proposes all k drafts (cost nearly flat in k)

    def __init__(
        self,
        model,
        *,
        vocab: int,
        sampling: Sampling,
        device: torch.device,
        max_draft: int,
        compiled: bool,
        make_runner: Callable[[int], ModelRunner],
        mask_token_id: int | None = None,
    ) -> None:
        """vocab: the target's vocabulary size; compiled: long feeds go in a few chunk shapes;
        make_runner(slots): this drafter's runner (cache, compiled steps, draft head);
        mask_token_id: read only by drafters that draft from mask tokens."""
        self.model, self.vocab, self.sampling, self.device = model, vocab, sampling, device
        self.max_draft, self.compiled, self.make_runner = max_draft, compiled, make_runner
        self._runner: ModelRunner | None = None
        self._runner_slots = 0

    @property
    def runner(self) -> ModelRunner:
        """This decode's drafter runner (built by `start`)."""
        if self._runner is None:
            self._runner = self.make_runner(self._runner_slots)
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self._runner = runner

    @property
    def reserved_ids(self) -> set[int]:
        """Target ids this drafter must never draft (e.g. its mask token)."""
        return set()

    # ------------------------------------------------------------------ vocabulary mapping
    def drafter_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token ids as this drafter's (identity: one shared vocabulary)."""
        return ids

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This drafter's logits over the target's vocabulary (padding cut or padded -inf)."""
        return match_vocab(logits, self.vocab)

    # ------------------------------------------------------------------ one decode
    def start(
        self,
        ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        mask: torch.Tensor,
        dense: bool,
        slots: int,
        cut: int = 0,
    ) -> None:
        """Begin a decode of the left-padded prompts `ids` (target ids) and prefill them; `mask`
        is the loop's shared slot mask (read, never written here). cut: the drafter skips the
        first `cut` prompt slots (`context.context_cut`)."""
        self._runner, self._runner_slots = None, slots - cut
        self.cut, self.dense = cut, dense
        self.mask = mask[:, cut:]  # a view: the loop's later writes show through
        # batched rows: positions are the target's minus the row's real tokens before the cut
        self.shift = prompt_mask[:, :cut].sum(1, keepdim=True) if cut and not dense else None
        prefill_prompt([self.runner], self.drafter_ids(ids[:, cut:]), prompt_mask[:, cut:], dense)

    @abstractmethod
    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
    ) -> Proposal:
        """Up to k drafts continuing the pending token t (B,) at positions pos (B,); with
        `keep_drafting`, confidences too (a step-by-step drafter stops at its first no)."""

    def _steps(
        self,
        logits: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None,
        feed: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> Proposal:
        """k 1-token draft steps from the first step's logits (B, V); feed(d, i) reads kept draft
        i for the next logits. Sets `fed`: drafts this cache has read (the last is not fed)."""
        want_q = keep_drafting is not None
        drafts, qs, confs = [], [], []
        for i in range(k):
            d, q = self._draw(logits, generator, want_q)
            if want_q:
                tops = q.max(-1).values.tolist()
                if not keep_drafting(tops):
                    break
                confs.append(tops)
            drafts.append(d)
            if not self.sampling.greedy:
                qs.append(q)
            if i + 1 < k:
                logits = feed(d, i)
        self.fed = len(drafts) if len(drafts) < k else k - 1
        b = logits.shape[0]
        return Proposal(
            tokens=torch.stack(drafts, 1) if drafts else logits.new_zeros(b, 0, dtype=torch.long),
            q=torch.stack(qs, 1) if qs else None,
            conf=[list(c) for c in zip(*confs)] if want_q else None,
            forwards=1 + self.fed,
        )

    @abstractmethod
    def skip(self, t: torch.Tensor, pos: torch.Tensor) -> None:
        """The target emitted after t (at pos) in a round the drafter did not draft (prompt
        lookup): this drafter has not read t."""

    @abstractmethod
    def accept(
        self, drafts: torch.Tensor, accepted: int, new_length: int, pos: torch.Tensor
    ) -> None:
        """After the verify: `accepted` of `drafts` (B, k) is the longest prefix over the rows;
        the target's cache holds `new_length` slots. Roll back the rest."""

    # ------------------------------------------------------------------ compile warm-up
    @abstractmethod
    def warm_shapes(self) -> tuple[tuple[int, int], ...]:
        """(tokens fed, logits kept) of every drafter step a decode may run (compiled warm-up)."""

    # ------------------------------------------------------------------ helpers
    def _forward(self, x: torch.Tensor, xpos: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append x (target ids; the target's positions xpos unless dense) to the cache; the
        last `keep` positions' logits over the target's vocabulary."""
        attn = None
        if not self.dense:
            attn = step_mask(self.runner, self._slot_mask(), self.runner.length + x.shape[1])
            if self.shift is not None:
                xpos = xpos - self.shift
        return self.target_logits(self.runner.forward(self.drafter_ids(x), attn, xpos, keep=keep))

    def _slot_mask(self) -> torch.Tensor:
        """This drafter's view of the shared mask, padded to a static cache's capacity (after a
        cut, a bucketed capacity may outgrow the view; those slots are never written)."""
        pad = self.runner.capacity - self.mask.shape[1] if self.runner.static else 0
        return torch.nn.functional.pad(self.mask, (0, pad)) if pad > 0 else self.mask

    def rollback(self, new_length: int) -> None:
        """Drop the drafter's slots from the target's slot `new_length` on."""
        self.runner.rollback(new_length - self.cut)

    def _feed(self, x, xpos, widths: list[int]):
        """Feed x's first sum(widths) tokens in chunks of these widths (compiled steps see few
        shapes); returns the rest of x and xpos."""
        start = 0
        for w in widths:
            cpos = None if self.dense else xpos[:, start : start + w]
            self._forward(x[:, start : start + w], cpos, keep=1)
            start += w
        return x[:, start:], None if self.dense else xpos[:, start:]

    @property
    def _chunked(self) -> bool:
        """Long feeds go in chunks of a few widths (compiled steps over a static cache)."""
        return self.compiled and self.runner.static

    def _draw(
        self, logits: torch.Tensor, generator: torch.Generator | None, want_q: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts from q (processed as p is) and q itself, which greedy computes only when
        `want_q` (confidences)."""
        if self.sampling.greedy:
            q = torch.softmax(logits.float(), -1) if want_q else None
            return greedy_tokens(logits), q
        q = probs_from_logits(logits, self.sampling)
        return sample_from(q, uniforms(tuple(logits.shape[:-1]), generator, self.device)), q
