"""Long-context prompts: whole documents cut at a boundary, bucketed by the target's tokens.

Short prompts (a signature and a docstring) say nothing about how a drafter holds up when the
context is long, and that is where hidden-state drafters lose their acceptance. This module
turns long documents into prompt sets by context length (pure functions; where documents come
from and the caching are in `specdistill.data.long_documents`):

- **cuts**: code is cut where a `def` / `async def` / `class` starts (methods and nested
  functions too), so the prompt is everything before it and the continuation starts that
  definition (repository-level completion); text is cut at a blank line (a paragraph
  boundary). The prompt ends at its last non-blank character: byte-level BPEs merge a newline
  with the next line's indentation, so the continuation starts with that whitespace token.
- **buckets**: `LO-HI` in the target's tokens, LO exclusive and HI inclusive (`512-2k` holds
  513..2048 tokens; `0-512` holds 1..512, as every prompt has a token). `k` = 1024.
- **selection**: for each bucket, cuts whose prompt lands in `(LO, HI]` (and at most
  `max_tokens`), drawn with a seeded RNG round-robin over documents (one per document before
  any document gives a second), so a bucket's prompts come from as many modules as it can;
  `max_tokens` leaves room for max_new_tokens + gamma + 1 (a `4k-8k` prompt then fits an
  8192-token target instead of being truncated by the stages' context guard).
"""

from __future__ import annotations

import ast
import random
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from specdistill.data.runtime import ConfigError

KILO = 1024
DEFAULT_BUCKETS = ("0-512", "512-2k", "2k-4k", "4k-8k")
TASKS = ("complete", "question", "both")
_EOL = re.compile(r"\r\n|\r|\n")
_BOUND = re.compile(r"^\s*(\d+)\s*([kK]?)\s*$")


@dataclass(frozen=True)
class Bucket:
    """Prompt lengths in (lo, hi] target tokens."""

    name: str
    lo: int
    hi: int

    def holds(self, tokens: int) -> bool:
        return self.lo < tokens <= self.hi


@dataclass(frozen=True)
class Cut:
    """Where a document is cut: the continuation starts at `offset` (a character index)."""

    offset: int
    name: str  # the definition's qualified name, or `L<line>` for a paragraph
    kind: str  # def | class | paragraph


# ----------------------------------------------------------------------------- buckets


def _bound(text: str) -> int | None:
    m = _BOUND.match(text)
    return None if m is None else int(m.group(1)) * (KILO if m.group(2) else 1)


def parse_bucket(spec: Any, field: str) -> Bucket:
    """`2k-4k` -> Bucket(2048, 4096); anything else is one error naming `field`."""
    parts = str(spec).split("-") if isinstance(spec, str | int) else []
    lo, hi = (_bound(parts[0]), _bound(parts[1])) if len(parts) == 2 else (None, None)
    if lo is None or hi is None or lo >= hi:
        raise ConfigError(
            f"{field}={spec!r} is not a bucket: write LO-HI prompt tokens with LO < HI, "
            "e.g. 0-512, 512-2k or 4k-8k (k = 1024; LO exclusive, HI inclusive)"
        )
    return Bucket(str(spec).replace(" ", ""), lo, hi)


def parse_buckets(buckets: Any, bucket: Any = None) -> tuple[Bucket, ...]:
    """The `dataset.buckets` list (or the one `dataset.bucket`), checked: non-empty, in
    increasing order and non-overlapping, so every prompt length has at most one bucket."""
    if bucket is not None:
        return (parse_bucket(bucket, "dataset.bucket"),)
    if buckets is None:
        buckets = DEFAULT_BUCKETS
    if isinstance(buckets, str) or not isinstance(buckets, Sequence) or not len(buckets):
        raise ConfigError(
            f"dataset.buckets={buckets!r} must be a non-empty list of LO-HI buckets, "
            "e.g. [0-512,512-2k,2k-4k,4k-8k]"
        )
    out = tuple(parse_bucket(b, f"dataset.buckets[{i}]") for i, b in enumerate(buckets))
    for i, (a, b) in enumerate(pairwise(out), start=1):
        if b.lo < a.hi:
            raise ConfigError(
                f"dataset.buckets[{i}]={b.name!r} overlaps or precedes {a.name!r}: list the "
                "buckets in increasing, non-overlapping order, e.g. [0-512,512-2k]"
            )
    return out


def bucket_of(tokens: int, buckets: Sequence[Bucket]) -> Bucket | None:
    """The bucket holding a prompt of `tokens` tokens, or None."""
    return next((b for b in buckets if b.holds(tokens)), None)


# ----------------------------------------------------------------------------- cuts


def line_starts(text: str) -> list[int]:
    """Character offset of every line as `ast` numbers lines (ends: \\n, \\r\\n, \\r only;
    `str.splitlines` also splits at form feeds, which the stdlib has, and would misalign)."""
    return [0, *(m.end() for m in _EOL.finditer(text) if m.end() < len(text))]


def code_cuts(text: str) -> list[Cut] | None:
    """Cut points at the start of every definition's `def`/`class` line (decorators stay in
    the prompt), or None when `text` is not Python. Definitions that share their line with
    other code (`class A: def f(): ...`) are skipped: no line boundary precedes them."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    starts = line_starts(text)
    lines = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    cuts: list[Cut] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                # lineno is the `def`/`class` line (decorators stay in the prompt); a cut needs
                # only whitespace before the keyword on that line, and something before it.
                row = child.lineno - 1
                if row > 0 and not lines[row][: child.col_offset].strip():
                    kind = "class" if isinstance(child, ast.ClassDef) else "def"
                    cuts.append(Cut(starts[row], name, kind))
                name += "."
            visit(child, name)

    visit(tree, "")
    return sorted(cuts, key=lambda c: c.offset)


def paragraph_cuts(text: str) -> list[Cut]:
    """Cut points at the first line after every run of blank lines (a paragraph boundary)."""
    cuts, pos, blank_before = [], 0, False
    for line_no, line in enumerate(text.splitlines(keepends=True), start=1):
        if line.strip():
            if blank_before and pos > 0:
                cuts.append(Cut(pos, f"L{line_no}", "paragraph"))
            blank_before = False
        else:
            blank_before = True
        pos += len(line)
    return cuts


def document_cuts(text: str, kind: str) -> list[Cut]:
    """Cuts for `kind` code (definitions), text (paragraphs) or auto (code when it parses)."""
    if kind in ("code", "auto"):
        cuts = code_cuts(text)
        if cuts is not None:
            return cuts
        if kind == "code":
            return []
    return paragraph_cuts(text)


def split_at(text: str, cut: Cut) -> tuple[str, str]:
    """(prompt, continuation) with prompt + continuation == text; the prompt ends at its last
    non-blank character, the continuation starts with the whitespace before the definition."""
    prompt = text[: cut.offset].rstrip()
    return prompt, text[len(prompt) :]


# ----------------------------------------------------------------------------- questions


def question_for(text: str, cut: Cut, rng: random.Random) -> tuple[str, str | None] | None:
    """A question about the prompt's own far context: what a function defined before the cut
    does (reference: its docstring's first line), or None where the prompt defines none with
    a docstring. The answer is in the prompt, often thousands of tokens back."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return (
            "\n\nQuestion: what is the text above about? Answer in one sentence.\nAnswer:",
            None,
        )
    starts = [*line_starts(text), len(text)]
    documented = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and ast.get_docstring(n)
        and n.end_lineno is not None
        and starts[min(n.end_lineno, len(starts) - 1)] <= cut.offset
    ]
    if not documented:
        return None
    node = rng.choice(sorted(documented, key=lambda n: n.lineno))
    doc = (ast.get_docstring(node) or "").strip().splitlines()[0]
    question = (
        f"\n\n# Question: what does `{node.name}` (defined above, line {node.lineno}) do? "
        "Answer in one line.\n# Answer:"
    )
    return question, " " + doc


# ----------------------------------------------------------------------------- selection


def prefix_counter(text: str, tokenizer: Any) -> Callable[[int], int]:
    """Approximate prompt length in tokens for any cut offset from ONE tokenization of the whole
    document (its offsets): tokens ending at or before the offset. Exact lengths are counted
    only for the prompts chosen, so a 30k-token module costs one encode, not one per cut.
    `verbose=False`: a whole module is meant to outrun the model's positions, so `transformers`'
    "longer than the maximum sequence length ... indexing errors" warning would be a false alarm
    here; prompts that do outrun the target are refused or cut by the decoder's own guard."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ends = [end for _, end in enc["offset_mapping"]]
    return lambda offset: bisect_right(ends, offset)


def count_tokens(text: str, tokenizer: Any) -> int:
    """Exact prompt length as the stages tokenize it (no special tokens added); quiet about
    lengths past the model's positions for the reason `prefix_counter` gives."""
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def round_robin(candidates: dict[str, list[Any]], rng: random.Random) -> Iterator[tuple[str, Any]]:
    """(document, item) pairs: documents in a seeded order, each document's items shuffled,
    one item per document per pass, so the first N pairs span as many documents as possible."""
    docs = sorted(candidates)
    rng.shuffle(docs)
    queues = {d: rng.sample(candidates[d], len(candidates[d])) for d in docs}
    while queues:
        for d in list(queues):
            yield d, queues[d].pop()
            if not queues[d]:
                del queues[d]


def interleave(per_bucket: dict[str, list[dict]]) -> list[dict]:
    """Rows in bucket-major round-robin order (b1, b2, .., b1, b2, ..): a stage that keeps the
    first N prompts (validate's num_prompts, dataset.limit) still sees every bucket."""
    out: list[dict] = []
    lists = [list(rows) for rows in per_bucket.values()]
    for i in range(max((len(r) for r in lists), default=0)):
        out.extend(r[i] for r in lists if i < len(r))
    return out
