"""`decoder.mapped_context=text`: the drafter q reads the target's text, re-tokenized by its own
tokenizer (what `transformers`' universal assisted generation, UAG, does), and drafts through the
vocabulary mapping.

p = target, q = drafter. Each round, every row's target tokens are decoded to text and encoded
by the drafter's tokenizer; the drafter's cache keeps the longest common prefix with what it
holds (BPE may re-split the last tokens once more text follows) and reads the rest.

The drafts are not re-tokenized, unlike UAG's: there one drafted token may become several
target tokens and nothing gives q(x) for a target token x, so speculative sampling cannot apply.
Here each draft is drawn from q moved into the target's ids, exactly as in `tli` mode, so the
acceptance rule stays exact for greedy and sampling; only the context differs (no unk for
target tokens the drafter lacks, which still cannot be drafted).

Batches: rows re-tokenize to different lengths, so the drafter keeps its own slot mask (discarded
tokens become holes); when the cache would overflow, every row is read again from slot 0.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.decode.cache import step_mask
from specdistill.decode.draft_length.costs import chunk_widths
from specdistill.decode.drafters.base import KeepDrafting, Proposal
from specdistill.decode.drafters.mapped import MappedDrafter


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n


class TextContextDrafter(MappedDrafter):
    """Text-mode context over the mapped drafter (see the module docstring)."""

    def start(self, ids, prompt_mask, mask, dense, slots, cut: int = 0) -> None:
        """Keep each row's target tokens (read as text at the first round); `cut`: the text of
        the prompt's first `cut` target slots is never read."""
        self.mask, self.dense, self.cut = mask, dense, cut
        b, plen = ids.shape
        self.rows: list[list[int]] = [
            ids[r, cut:-1][prompt_mask[r, cut:-1]].tolist() for r in range(b)
        ]
        self.tlen = plen - 1  # slots in the target's cache (t goes at this slot)
        self.pending: list[int] = []  # the round's t, per row (host)
        self.cached: list[list[int]] = [[] for _ in range(b)]  # drafter ids held, per row
        self.cslots: list[list[int]] = [[] for _ in range(b)]  # and their slots
        self.fed_log: tuple[torch.Tensor, int, list[int]] | None = None  # drafts fed, not logged
        longest = max(len(self._retokenize(row)) for row in self.rows)
        self.runner = self.make_runner(2 * longest + 4 * (slots - plen) + 64)
        self.dmask = torch.zeros(b, self.runner.capacity, dtype=torch.bool, device=self.device)

    def _retokenize(self, target_ids: list[int]) -> list[int]:
        text = self.mapped.target_tokenizer.decode(target_ids, skip_special_tokens=True)
        out = self.mapped.draft_tokenizer.encode(text, add_special_tokens=False)
        return list(out) or [self.mapped.draft_unk]

    def _dforward(self, x: torch.Tensor, xpos: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Append drafter ids x to the drafter's cache; log q over the target's ids."""
        width = self.runner.length + x.shape[1]
        attn = None if self.dense else step_mask(self.runner, self.dmask, width)
        return self.target_logits(self.runner.forward(x, attn, xpos, keep=keep))

    def _log_fed(self) -> None:
        """Record last round's drafts fed to the cache (one host copy, deferred to here)."""
        if self.fed_log is None:
            return
        drafts, first, _ = self.fed_log
        for r, row in enumerate(drafts.tolist()):
            self.cached[r] += row
            self.cslots[r] += range(first, first + len(row))
        self.fed_log = None

    def _read_context(self, t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Bring the drafter's cache to each row's re-tokenized text; the last position's log q
        (B, 1, V) and each row's drafter length."""
        self._log_fed()
        self.pending = t.tolist()
        news = [self._retokenize([*row, x]) for row, x in zip(self.rows, self.pending)]
        b = len(news)
        keep = [common_prefix(c, n, len(n) - 1) for c, n in zip(self.cached, news)]
        kept_end = max((s[k - 1] + 1 if k else 0) for s, k in zip(self.cslots, keep))
        widths = [len(n) - k for n, k in zip(news, keep)]
        width = max(widths)
        if kept_end + width + self.max_draft > self.runner.capacity:  # compact: read all again
            keep, kept_end, widths = [0] * b, 0, [len(n) for n in news]
            width = max(widths)
            if width + self.max_draft > self.runner.capacity:
                raise RuntimeError(
                    f"text context of {width} drafter tokens exceeds the drafter cache "
                    f"({self.runner.capacity} slots)"
                )
        self.runner.rollback(kept_end)
        holes = [(r, s) for r in range(b) for s in self.cslots[r][keep[r] :] if s < kept_end]
        self.dmask[:, kept_end:] = False
        if holes:
            rr, ss = zip(*holes)
            self.dmask[list(rr), list(ss)] = False
        x = torch.full((b, width), self.mapped.draft_unk, dtype=torch.long)
        xpos = torch.zeros((b, width), dtype=torch.long)
        for r in range(b):
            m = widths[r]
            x[r, width - m :] = torch.tensor(news[r][keep[r] :], dtype=torch.long)
            xpos[r, width - m :] = torch.arange(keep[r], len(news[r]))
            self.dmask[r, kept_end + width - m : kept_end + width] = True
            self.cached[r] = news[r]
            self.cslots[r] = self.cslots[r][: keep[r]] + list(
                range(kept_end + width - m, kept_end + width)
            )
        x, xpos = x.to(self.device), xpos.to(self.device)
        chunks = chunk_widths(width) if self._chunked and width > 2 else [width]
        start = 0
        for w in chunks:
            cpos = None if self.dense else xpos[:, start : start + w]
            logits = self._dforward(x[:, start : start + w], cpos, keep=1)
            start += w
        return logits, [len(n) for n in news]

    def propose(
        self,
        t: torch.Tensor,
        pos: torch.Tensor,
        k: int,
        generator: torch.Generator | None,
        keep_drafting: KeepDrafting | None = None,
    ) -> Proposal:
        """Read the context as text, then up to k 1-token drafter steps; drafts are target
        ids, fed back as the drafter's ids."""
        logits, lengths = self._read_context(t)
        first = self.runner.length
        base_pos = torch.tensor(lengths, device=self.device)[:, None]
        fed: list[torch.Tensor] = []

        def feed(d: torch.Tensor, i: int) -> torch.Tensor:
            x = self.t2d[d][:, None]
            fed.append(x)
            if not self.dense:
                self.dmask[:, self.runner.length] = True
            return self._dforward(x, None if self.dense else base_pos + i, keep=1)[:, -1]

        prop = self._steps(logits[:, -1], k, generator, keep_drafting, feed)
        if fed:
            self.fed_log = (torch.cat(fed, 1), first, lengths)
        return prop

    def skip(self, t: torch.Tensor, pos: torch.Tensor) -> None:
        """A prompt-lookup round's token: t joins each row's target tokens (read as text next
        round)."""
        for row, x in zip(self.rows, t.tolist()):
            row.append(x)
        self.tlen += 1

    def accept(
        self, drafts: torch.Tensor, accepted: int, new_length: int, pos: torch.Tensor
    ) -> None:
        """Each row keeps t and the drafts it accepted (per the shared mask; the batch's count at
        batch 1); the drafter's cache is reconciled next round."""
        k = drafts.shape[1]
        if self.dense:
            counts = [new_length - self.tlen - 1]
        else:
            counts = self.mask[:, self.tlen + 1 : self.tlen + 1 + k].sum(1).tolist()
        for row, x, d, n in zip(self.rows, self.pending, drafts.tolist(), counts):
            row += [x, *d[:n]]
        self.tlen = new_length

    def warm_shapes(self) -> tuple[tuple[int, int], ...]:
        """1-token drafts and the context reads: power-of-two chunks when compiled."""
        return ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1))

    def drafter_state(self) -> dict[str, Any]:
        """Per-row drafter tokens held (tests)."""
        return {"cached": [list(c) for c in self.cached], "rows": [list(r) for r in self.rows]}
