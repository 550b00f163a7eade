"""The toy world's prompt sets: functions with a docstring, cut after it (HumanEval-like).

The prompt is a function's signature + docstring, the completion the rest of its body (the
reference answer of fixed-data distillation). `prompt_set` spreads a cap over modules; the sets
are stored as jsonl.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from specdistill.data.toy.corpus import read_source, stdlib_dir


def extract_prompts(text: str, module: str) -> list[dict]:
    """Functions with a docstring, cut right after the docstring's closing quotes.

    The prompt is the dedented signature + docstring; the completion is the rest of the body,
    used as the reference answer by fixed-data distillation.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    rows = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc = node.body[0]
        indent = lines[node.lineno - 1][: node.col_offset]
        if indent.strip():  # e.g. `class A: def f(): ...` on one line
            continue
        last = lines[doc.end_lineno - 1].encode("utf-8")
        head = last[: doc.end_col_offset].decode("utf-8", errors="ignore")
        tail = last[doc.end_col_offset :].decode("utf-8", errors="ignore")
        prompt_lines = [*lines[node.lineno - 1 : doc.end_lineno - 1], head]
        completion_lines = [tail, *lines[doc.end_lineno : node.end_lineno]]
        prompt = "".join(_dedent(prompt_lines, indent))
        completion = "".join(_dedent(completion_lines, indent))
        if not completion.strip() or len(prompt) > 800:
            continue
        rows.append(
            {
                "prompt": prompt,
                "completion": completion[:1500],
                "module": module,
                "name": node.name,
            }
        )
    return rows


def _dedent(lines: list[str], indent: str) -> list[str]:
    return [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines]


def prompt_set(paths: list[Path], limit: int) -> list[dict]:
    """The prompts of the stdlib files `paths`, at most `limit`, in a fixed hash order."""
    base = stdlib_dir()
    rows: list[dict] = []
    for p in paths:
        text = read_source(p)
        if text:
            rows.extend(extract_prompts(text, p.relative_to(base).as_posix()))

    # Spread the cap over modules instead of taking the first few files whole.
    def key(r: dict) -> str:
        return hashlib.md5(f"{r['module']}:{r['name']}:{r['prompt'][:64]}".encode()).hexdigest()

    return sorted(rows, key=key)[:limit]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line (callers publish the file by rename or a `build_once` swap)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a jsonl prompt set (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
