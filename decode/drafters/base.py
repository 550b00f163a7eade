"""`Drafter`: the one small interface through which the round loop drives any kind of drafter q.

p = target, q = drafter, gamma (k) = drafts per round. `SpeculativeDecoder.generate` is the only
round loop; what differs between kinds of drafter (autoregressive: k 1-token steps; parallel: one
forward over k-1 mask tokens; mapped: another tokenizer) lives behind these methods:

- `start`: begin a decode over the shared slot layout (prefill now, or lazily at the first
  `propose` when the decode may never draft);
- `propose`: k drafts, their q over the target's vocabulary (None when greedy) and, when a
  draft-length policy reads q, each draft's confidence (q of the drafted token);
- `skip`: the target emitted a token in a plain step (the floor); read it in the next forward;
- `accept`: after the verify, keep the longest accepted prefix and roll the rest back;
- `draft_widths` / `warm_shapes`: the forwards a round costs (timing, compile warm-up);
- `drafter_ids` / `target_logits`: the vocabulary mapping. The loop speaks the target's ids
  only; a drafter with its own tokenizer maps ids in and logits out (here: identity, with a
  vocabulary smaller or larger only by padding).

Both caches share one slot layout (`specdistill.decode.cache`): slot i of the drafter's cache
holds the token of slot i of the target's, so the loop's 2-D mask serves both; a drafter that
reads only the end of the prompt (`decoder.drafter_context`, `context.py`) skips the first `cut`
slots: its slot i is the target's slot i + cut, its view of the mask starts there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.data.models.pairs import match_vocab
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import greedy_tokens, probs_from_logits, sample_from, uniforms
from specdistill.decode.cache import ModelRunner, step_mask
from specdistill.decode.prefill_memo import PrefillMemo, prefill_timed

# keep_drafting(drafted, conf): after `drafted` drafts, the latest with confidence conf[r] per
# row: draft another? (a draft-length policy's stopping rule; reads q only, so it is lossless)
KeepDrafting = Callable[[int, list[float]], bool]


@dataclass
class Proposal:
    """A round's drafts: tokens (B, k) in the target's ids; q (B, k, V) the drafter's
    distributions over the target's vocabulary they were sampled from (None when greedy);
    conf[r][j] q's probability of row r's draft j (only when asked for); forwards: drafter
    forwards spent; shadow (B, s): q's verdict on the last s tokens the target emitted in plain
    steps, which this round's first forward read anyway (see `Drafter.propose`), else None."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    conf: list[list[float]] | None
    forwards: int
    shadow: torch.Tensor | None = None


class Drafter(ABC):
    """A drafting strategy over one drafter model q (see the module docstring)."""

    parallel = False  # one forward proposes all k drafts (cost nearly flat in k)
    prefill_memo: PrefillMemo | None = None  # the decoder's (decode.prefill_memo), when it has one
    prefill_saved = 0.0  # seconds of this decode's prefill a memo restored instead of running

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
        """vocab: the target's vocabulary size; max_draft: most drafts a round proposes;
        compiled: some decode steps are compiled (long feeds go in a few chunk shapes);
        make_runner(slots): this drafter's runner as the decoder builds it (caches, compiled
        steps, draft head); mask_token_id: read by drafters that draft from mask tokens."""
        self.model, self.vocab, self.sampling, self.device = model, vocab, sampling, device
        self.max_draft, self.compiled, self.make_runner = max_draft, compiled, make_runner
        self._runner: ModelRunner | None = None
        self._runner_slots = 0

    @property
    def runner(self) -> ModelRunner:
        """This decode's drafter runner, built at its first use: a decode the floor keeps from
        drafting never builds one, so its plain steps cost what target-only decoding does (for
        a small pair building the cache is a visible share of a decode)."""
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
        lazy: bool,
        cut: int = 0,
    ) -> None:
        """Begin a decode of the left-padded prompts `ids` (target ids); `mask` is the loop's
        shared slot mask (read, never written here). lazy: prefill at the first `propose`, so
        a decode that never drafts costs what target-only decoding does. cut: the drafter skips
        the first `cut` prompt slots (`context.context_cut`)."""
        self._runner, self._runner_slots = None, slots - cut  # built at first use (`runner`)
        self.cut, self.dense = cut, dense
        self.mask = mask[:, cut:]  # a view: the loop's later writes show through
        # batched rows: positions are the target's minus the row's real tokens before the cut
        self.shift = prompt_mask[:, :cut].sum(1, keepdim=True) if cut and not dense else None
        self._prompt: tuple[torch.Tensor, torch.Tensor] | None = (
            ids[:, cut:],
            prompt_mask[:, cut:],
        )
        self.prefill_seconds = 0.0  # this decode's prefill of q's cache (0 until it runs)
        self.prefill_saved = 0.0  # of those, seconds a prefill memo restored instead of running
        if not lazy:
            self._prefill()

    def _prefill(self) -> None:
        if self._prompt is not None:
            ids, prompt_mask = self._prompt
            pre = prefill_timed(
                self.runner, self.drafter_ids(ids), prompt_mask, self.dense, self.prefill_memo
            )
            self.prefill_seconds, self.prefill_saved = pre.seconds, pre.saved
            self._prompt = None

    @abstractmethod
    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
        shadow: int = 0,
    ) -> Proposal:
        """Up to k drafts continuing the pending token t (B,) at positions pos (B,). When
        `keep_drafting` is given, confidences are returned; a drafter that drafts step by step
        stops once it says no, one that proposes all k at once leaves the cut to the policy.

        shadow: the last `shadow` tokens this forward reads (t included) were emitted by the
        floor's plain target steps, so no draft ever tested q there. Their logits cost only
        head rows in a forward that runs anyway: return q's verdict on up to that many of
        them (`Proposal.shadow`, via `_shadow`) so the policy learns q's first-draft acceptance
        from the rounds it skipped (eager steps only: compiled steps keep fixed shapes)."""

    def _shadow(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """q's probability of each of `tokens` (B, s) from the logits (B, s, V) of the context
        before it, under the sampling spec drafts are drawn with (greedy: 1 where its argmax
        is the token, else 0). Divided by p's probability of the token (1 when greedy) and
        clipped at 1 it is an unbiased estimate of the acceptance a draft would have had there:
        E_{x~p}[min(1, q(x)/p(x))] = sum_x min(p(x), q(x))."""
        if self.sampling.greedy:
            return (greedy_tokens(logits) == tokens).float()
        q = probs_from_logits(logits, self.sampling)
        return q.gather(-1, tokens[..., None])[..., 0]

    @abstractmethod
    def skip(self, t: torch.Tensor, pos: torch.Tensor) -> None:
        """The target emitted after t (at pos) in a plain step: this drafter has not read t."""

    @abstractmethod
    def accept(
        self, drafts: torch.Tensor, accepted: int, new_length: int, pos: torch.Tensor
    ) -> None:
        """After the verify: the longest accepted prefix over the rows is `accepted` of the
        verified `drafts` (B, k); the target's cache now holds `new_length` slots; pos (B,) the
        round's pending-token positions. Keep what is needed for the next round, roll back the
        rest."""

    # ------------------------------------------------------------------ cost
    @abstractmethod
    def draft_widths(self, k: int) -> tuple[int, ...]:
        """Tokens fed by each drafter forward of a round of k drafts, in the steady state (what
        `StepTimer.draft` times for the draft-length policies' costs)."""

    @abstractmethod
    def warm_shapes(self, adaptive: bool) -> tuple[tuple[int, int], ...]:
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
        cut, a compiled drafter's bucketed capacity may outgrow the view; slots past the
        decode's are never written)."""
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
        """Drafts from q (argmax when greedy, else sampled after the sampling spec's
        temperature/top-k/top-p, as applied to p) and q itself: always when sampling, for
        greedy only when `want_q` (confidences)."""
        if self.sampling.greedy:
            q = torch.softmax(logits.float(), -1) if want_q else None
            return greedy_tokens(logits), q
        q = probs_from_logits(logits, self.sampling)
        return sample_from(q, uniforms(tuple(logits.shape[:-1]), generator, self.device)), q


def confidences(q: torch.Tensor, drafts: torch.Tensor) -> list:
    """q's probability of each draft: (B,) -> B floats, (B, k) -> B lists of k."""
    return q.gather(-1, drafts[..., None])[..., 0].tolist()
