"""Prompt sources for online adaptation's shifted stream: stdlib parts the toy world never saw.

The toy world trains both models on the stdlib's `.py` files, minus the folders in
`specdistill.data.toy.corpus.SKIP_DIRS`, and draws every training prompt from them. Two kinds of
source lie outside that corpus:

- code groups (`stdlib-tests`: CPython's regression suite `test/`; `stdlib-gui`: the tkinter
  applications `idlelib/` and `turtledemo/`): whole skipped packages, prompts extracted with
  the toy world's own `extract_prompts` (signature + docstring). They are still Python, much
  like the training code, so a frozen distilled drafter loses little on them (distill/RESULTS.md).
- text groups (`stdlib-mail`, `stdlib-numeric`, `stdlib-certs`, `stdlib-prose`,
  `stdlib-markup`): the non-`.py` files the stdlib ships (e-mail test messages; decimal and
  math test tables; PEM certificates; release notes and READMEs; XML/HTML). No model ever
  trained on a byte of them (the corpus reads `*.py` only) and they are not code, so the shift
  matters for mail, numeric and certs (toy pair, distilled drafter, greedy, 16 prompts each:
  frozen alpha 0.78 on toy-test; mail 0.64, numeric tables 0.48-0.61, certs 0.55). Prose and
  markup barely move it (0.83, 0.82): on them the toy target falls into repetitive filler
  that the drafter predicts as well as it does. Prompts are windows of whole lines cut from
  each file; the completion is the text that follows.

Every group's files are disjoint from every other group's and from the corpus (tested).
Prompts are cached under `$SPECDISTILL_HOME/toy_stream` with their own version: the toy world's
cache (`TOY_VERSION`) is untouched.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from specdistill.data.io import atomic_write_text
from specdistill.data.runtime import specdistill_home
from specdistill.data.toy.code_prompts import prompt_set, read_jsonl
from specdistill.data.toy.corpus import read_source, stdlib_dir

# Bump when an extraction below changes, so stale caches are not reused.
STREAM_VERSION = 1  # code groups
TEXT_VERSION = 2  # text groups (v1: prompts ended in a newline)
# Code groups: top-level stdlib packages (all in the toy world's skip list).
STREAM_GROUPS: dict[str, tuple[str, ...]] = {
    "stdlib-tests": ("test",),
    "stdlib-gui": ("idlelib", "turtledemo"),
}
# Text groups: glob patterns relative to the stdlib folder; never `.py` files.
TEXT_GROUPS: dict[str, tuple[str, ...]] = {
    "stdlib-mail": ("test/test_email/data/msg_*.txt",),  # RFC 822 messages: headers, MIME
    "stdlib-numeric": (  # arithmetic test tables: `addx001 add 1 1 -> 2`, float bit patterns
        "test/decimaltestdata/*.decTest",
        "test/*_testcases.txt",
        "test/floating_points.txt",
        "test/ieee754.txt",
    ),
    "stdlib-certs": ("test/*.pem", "test/certdata/*.pem"),  # PEM: base64 blocks
    "stdlib-prose": (  # English: IDLE's release notes and READMEs, the licence, a design note
        "idlelib/*.txt",
        "idlelib/idle_test/README.txt",
        "test/leakers/README.txt",
        "LICENSE.txt",
        "email/architecture.rst",
    ),
    "stdlib-markup": (  # HTML and XML
        "test/xmltestdata/**/*.xml",
        "test/*.xml",
        "test/test_difflib_expect.html",
        "idlelib/help.html",
    ),
}
SOURCE_GROUPS = (*STREAM_GROUPS, *TEXT_GROUPS)
_MAX_PROMPTS = 2000
_PROMPT_CHARS = 400  # a text prompt: whole lines, at least this many characters ...
_MAX_PROMPT_CHARS = 800  # ... and at most this many
_COMPLETION_CHARS = 600
_STRIDE_LINES = 6  # a new prompt window starts every this many lines


def group_files(group: str) -> list[Path]:
    """A group's files, sorted (deterministic): `.py` for code groups, text for text groups."""
    base = stdlib_dir()
    files: set[Path] = set()
    if group in STREAM_GROUPS:
        for package in STREAM_GROUPS[group]:
            files.update((base / package).rglob("*.py"))
    elif group in TEXT_GROUPS:
        for pattern in TEXT_GROUPS[group]:
            files.update(p for p in base.glob(pattern) if p.is_file() and p.suffix != ".py")
    else:
        raise KeyError(group)
    return sorted(files)


def text_prompts(text: str, module: str) -> list[dict]:
    """Windows of whole lines (`_PROMPT_CHARS`..`_MAX_PROMPT_CHARS`), one every
    `_STRIDE_LINES` lines; the completion is the next `_COMPLETION_CHARS` characters."""
    lines = text.splitlines(keepends=True)
    rows = []
    for start in range(0, len(lines), _STRIDE_LINES):
        end, size = start, 0
        while end < len(lines) and size < _PROMPT_CHARS:
            size += len(lines[end])
            end += 1
        # The prompt stops before its last newline: the toy BPE merges a newline with the next
        # line's indentation, and a prompt ending in a bare newline token sends the toy target
        # into a loop of newlines (alpha 1.0 for any drafter, no signal at all).
        text_ = "".join(lines[start:end])
        prompt = text_.rstrip("\r\n")
        completion = (text_[len(prompt) :] + "".join(lines[end:]))[:_COMPLETION_CHARS]
        if size > _MAX_PROMPT_CHARS or not prompt.strip() or not completion.strip():
            continue
        rows.append(
            {"prompt": prompt, "completion": completion, "module": module, "name": f"L{start + 1}"}
        )
    return rows


def _text_prompt_set(paths: list[Path]) -> list[dict]:
    base = stdlib_dir()
    rows: list[dict] = []
    for p in paths:
        text = read_source(p)
        if text:
            rows.extend(text_prompts(text, p.relative_to(base).as_posix()))

    def key(r: dict) -> str:  # spread the cap over files, as the code groups do
        return hashlib.md5(f"{r['module']}:{r['name']}".encode()).hexdigest()

    return sorted(rows, key=key)[:_MAX_PROMPTS]


def group_prompts(group: str) -> list[dict]:
    """Prompt rows (prompt, completion, module, name) of one group; cached after the first call."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    version = STREAM_VERSION if group in STREAM_GROUPS else TEXT_VERSION
    cache = specdistill_home() / "toy_stream" / f"{group}-v{version}-{py}.jsonl"
    if cache.exists():
        return read_jsonl(cache)
    files = group_files(group)
    rows = prompt_set(files, _MAX_PROMPTS) if group in STREAM_GROUPS else _text_prompt_set(files)
    atomic_write_text(cache, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows
