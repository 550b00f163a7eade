"""The online learning signal: verified positions with the target's top-k, in a bounded buffer.

Verification already computed the target p's distribution at every drafted position
(`RoundRecord.target_probs`, temperature 1), so no extra target forward is needed. Positions
0..n of a round (n = drafts accepted) all lie on the emitted sequence: the drafts before them
were kept, so the context is prompt + emitted tokens. Position n is the drafter's rejected
token (when n < gamma); `record: all` keeps the accepted ones and the bonus position too.
Positions after the first rejection saw a rejected draft as context and are not on the
sequence, so they are never kept.

A full fp32 row at a 128k vocabulary is 512 KB; each kept position stores the target's top-k
token ids (int32) and log-probabilities (fp32, normalised over the full vocabulary, so the rest
mass is 1 - sum exp and needs no field), i.e. 8 K bytes, and trains with the (K+1)-way top-k
loss of `specdistill.distill.losses`. Rounds are converted right after each request, so the
decoder's full rows never outlive it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from specdistill.decode.speculative import DecodeOutput

RECORD_MODES = ("rejected", "all")


@dataclass
class Entry:
    """One request's kept positions. `positions[i]` indexes `ids`: its logits predict the token
    whose target distribution is (`topk_ids[i]`, `topk_lp[i]`)."""

    request: int
    ids: torch.Tensor  # (L,) int32: prompt + emitted tokens
    positions: torch.Tensor  # (n,) int64
    topk_ids: torch.Tensor  # (n, K) int32
    topk_lp: torch.Tensor  # (n, K) fp32 log p (T = 1)

    @property
    def tokens(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ids, self.positions, self.topk_ids, self.topk_lp)

    def row(self) -> tuple:
        """The entry as a checkpoint keeps it (`Entry(*row)` reads it back)."""
        return (self.request, self.ids, self.positions, self.topk_ids, self.topk_lp)

    def trimmed(self, keep: int) -> Entry:
        """The newest `keep` positions only."""
        s = slice(len(self.positions) - keep, None)
        return Entry(self.request, self.ids, self.positions[s], self.topk_ids[s], self.topk_lp[s])


def entries_from_output(
    out: DecodeOutput,
    prompts: list[list[int]],
    request_ids: list[int],
    k: int,
    record: str = "rejected",
) -> list[Entry]:
    """Per-row entries (top-k of the recorded target rows) from one `generate` call."""
    if record not in RECORD_MODES:
        raise ValueError(f"record={record!r}: use one of {RECORD_MODES}")
    rows: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    for rec in out.rounds:
        if rec.target_probs is None:
            raise ValueError("the decoder did not record target probabilities (record_probs)")
        lp, ids = rec.target_probs.topk(k, dim=-1)  # (B, G+1, K)
        lp = lp.clamp_min(torch.finfo(torch.float32).tiny).log()
        accepted = rec.accepted.tolist()
        for r, active in enumerate(rec.active):
            if not active:
                continue
            n = accepted[r]
            # drafts row r verified (each row verifies its own); n == gamma: a bonus
            gamma = rec.lengths[r] if rec.lengths is not None else rec.draft.shape[1]
            js = range(n + 1) if record == "all" else ([n] if n < gamma else [])
            for j in js:
                idx = rec.start[r] + j  # index of the predicted token among the emitted ones
                if idx < len(out.tokens[r]):  # positions past a stop were never served
                    rows[r].append((idx, ids[r, j].to(torch.int32), lp[r, j]))
    entries = []
    for r, kept in enumerate(rows):
        seq = torch.tensor(prompts[r] + out.tokens[r], dtype=torch.int32)
        plen = len(prompts[r])
        if kept:
            pos = torch.tensor([plen - 1 + idx for idx, _, _ in kept], dtype=torch.int64)
            tid = torch.stack([t for _, t, _ in kept]).cpu()
            tlp = torch.stack([v for _, _, v in kept]).cpu()
        else:
            pos = torch.zeros(0, dtype=torch.int64)
            tid = torch.zeros(0, k, dtype=torch.int32)
            tlp = torch.zeros(0, k, dtype=torch.float32)
        entries.append(Entry(request_ids[r], seq, pos, tid, tlp))
    return entries


def entry_from_tokens(request: int, prompt: list[int], tokens: list[int]) -> Entry | None:
    """An engine's served answer as buffer positions (engine=llamacpp reports no probabilities):
    the logits at position P-1+j (P: the prompt's length) predict emitted token j, labelled with
    that token at probability 1 (top-1, no rest mass), so the (K+1)-way forward KL there is the
    cross-entropy on the target's token."""
    if not tokens:
        return None
    ids = torch.tensor(prompt + tokens, dtype=torch.int32)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens), dtype=torch.int64)
    labels = torch.tensor(tokens, dtype=torch.int32)[:, None]
    return Entry(request, ids, positions, labels, torch.zeros(len(tokens), 1))


class ReplayBuffer:
    """Kept positions of recent requests, at most `capacity` positions; oldest out first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be positive")
        self.capacity = capacity
        self.entries: deque[Entry] = deque()
        self.tokens = 0
        self.peak_nbytes = 0

    def add(self, entry: Entry) -> None:
        if entry.tokens == 0:
            return
        if entry.tokens > self.capacity:
            entry = entry.trimmed(self.capacity)
        self.entries.append(entry)
        self.tokens += entry.tokens
        while self.tokens > self.capacity:
            old = self.entries.popleft()
            over = self.tokens - self.capacity
            self.tokens -= old.tokens
            if old.tokens > over:  # keep the newest part of the oldest entry
                self.entries.appendleft(old.trimmed(old.tokens - over))
                self.tokens += old.tokens - over
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def sample(self, n: int, generator: torch.Generator) -> list[Entry]:
        """`n` entries drawn uniformly with replacement (empty buffer: none)."""
        if not self.entries:
            return []
        idx = torch.randint(len(self.entries), (n,), generator=generator).tolist()
        return [self.entries[i] for i in idx]

    def sample_halves(
        self, n: int, generator: torch.Generator
    ) -> tuple[list[Entry], list[Entry]] | None:
        """Two disjoint sets of up to `n // 2` entries each, drawn without replacement (None
        with fewer than 2 entries): independent evidence for the agreement gate."""
        if len(self.entries) < 2:
            return None
        half = max(1, min(n // 2, len(self.entries) // 2))
        idx = torch.randperm(len(self.entries), generator=generator)[: 2 * half].tolist()
        return [self.entries[i] for i in idx[:half]], [self.entries[i] for i in idx[half:]]

    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "peak_nbytes": self.peak_nbytes,
            "entries": [(e.request, *e._tensors()) for e in self.entries],
        }

    def load_state_dict(self, state: dict) -> None:
        self.capacity = int(state["capacity"])
        self.entries = deque(Entry(*row) for row in state["entries"])
        self.tokens = sum(e.tokens for e in self.entries)
        self.peak_nbytes = int(state["peak_nbytes"])
