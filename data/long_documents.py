"""`dataset.source=long`: long-context prompt rows from whole documents, bucketed by length.

Documents are the Python standard library's own modules (`documents: stdlib`, no download)
or the long-text `document_field` of any jsonl/json/parquet file or hub dataset. Both are held
out by document with the toy world's own rule (`specdistill.data.toy.corpus.is_held_out`: a
module is in train or test, never both, and stdlib modules fall exactly as the toy world's
prompts do), then cut and bucketed in the TARGET's tokens (`specdistill.data.long_prompts`).
Rows carry `bucket` and `tokens` columns so reports can group by context length.

Counting needs the target's tokenizer, so every stage passes it to `load_prompts` already.
Rows are cached under `$SPECDISTILL_HOME/long_prompts`, keyed by the settings and a digest of
the tokenizer (the stdlib's ~600 training modules take seconds to tokenize, every stage reads
them again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdistill.data.io import atomic_write_text
from specdistill.data.long_prompts import (
    TASKS,
    Bucket,
    document_cuts,
    interleave,
    parse_buckets,
    prefix_counter,
    question_for,
    round_robin,
    split_at,
)
from specdistill.data.runtime import ConfigError, specdistill_home

log = logging.getLogger(__name__)

LONG_VERSION = 1  # bump when a cut, a question or the selection changes
DOCUMENT_SOURCES = ("stdlib", "jsonl", "json", "parquet", "hub")
KINDS = ("auto", "code", "text")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _int(cfg: Any, key: str, default: int | None, minimum: int) -> int | None:
    value = _get(cfg, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"dataset.{key}={value!r} must be an integer >= {minimum}")
    return value


def long_settings(cfg: Any) -> dict[str, Any]:
    """The `dataset` node's long-prompt settings, checked (each error names its field)."""
    documents = str(_get(cfg, "documents", "stdlib"))
    if documents not in DOCUMENT_SOURCES:
        raise ConfigError(
            f"dataset.documents={documents!r} is not known; use one of {', '.join(DOCUMENT_SOURCES)}"
        )
    kind, task = str(_get(cfg, "kind", "auto")), str(_get(cfg, "task", "complete"))
    if kind not in KINDS:
        raise ConfigError(f"dataset.kind={kind!r} must be one of {', '.join(KINDS)}")
    if task not in TASKS:
        raise ConfigError(f"dataset.task={task!r} must be one of {', '.join(TASKS)}")
    buckets = parse_buckets(_get(cfg, "buckets"), _get(cfg, "bucket"))
    max_tokens = _int(cfg, "max_tokens", None, 1)
    for b in buckets:
        if max_tokens is not None and max_tokens <= b.lo:
            raise ConfigError(
                f"dataset.max_tokens={max_tokens} leaves bucket {b.name!r} empty (its prompts "
                f"have more than {b.lo} tokens): raise dataset.max_tokens or drop the bucket"
            )
    return {
        "documents": documents,
        "path": _get(cfg, "path"),
        "name": _get(cfg, "name"),
        "document_field": str(_get(cfg, "document_field", "text")),
        "id_field": _get(cfg, "id_field"),
        "kind": kind,
        "task": task,
        "buckets": [(b.name, b.lo, b.hi) for b in buckets],
        "per_bucket": _int(cfg, "per_bucket", None, 1),
        "max_tokens": max_tokens,
        "seed": _int(cfg, "seed", 0, 0),
        "completion_chars": _int(cfg, "completion_chars", 2000, 1),
    }


# ----------------------------------------------------------------------------- documents


def stdlib_documents(split: str) -> list[tuple[str, str]]:
    """(module path, source) of the stdlib modules in the toy world's split: the very files
    `corpus_files` assigns to train or held-out (test)."""
    from specdistill.data.toy.corpus import corpus_files, read_source, stdlib_dir

    train, held = corpus_files()
    base = stdlib_dir()
    paths = train if split == "train" else held
    return [
        (p.relative_to(base).as_posix(), t) for p in paths if (t := read_source(p)) and t.strip()
    ]


def file_documents(s: dict[str, Any], split: str) -> list[tuple[str, str]]:
    """(document key, text) of a file or hub dataset's rows held out into `split` by the toy
    world's rule on the key (`id_field`'s value, else the row's index)."""
    from specdistill.data.dataset_rows import file_rows, hub_rows
    from specdistill.data.toy.corpus import is_held_out

    source, field = s["documents"], s["document_field"]
    node = {"path": s["path"], "name": s["name"], "split": None}
    rows = hub_rows(node, "train") if source == "hub" else file_rows(node, source, "train")
    if rows and field not in rows[0]:
        raise ConfigError(
            f"dataset.document_field={field!r} is not a column of the documents; columns are "
            f"{sorted(rows[0])}"
        )
    id_field = s["id_field"]
    if rows and id_field and id_field not in rows[0]:
        raise ConfigError(f"dataset.id_field={id_field!r} is not one of {sorted(rows[0])}")
    docs = []
    for i, row in enumerate(rows):
        key, text = str(row[id_field] if id_field else i), row[field]
        if not isinstance(text, str):
            raise ConfigError(f"dataset.document_field={field!r} holds non-text values")
        if text.strip() and is_held_out(key) == (split == "test"):
            docs.append((key, text))
    return docs


# ----------------------------------------------------------------------------- rows


def long_rows(
    docs: list[tuple[str, str]], tokenizer: Any, s: dict[str, Any]
) -> list[dict[str, Any]]:
    """Prompt rows (prompt, completion, bucket, tokens, module, name, task) from `docs`:
    per bucket up to `per_bucket` cuts, drawn round-robin over documents with a seeded RNG
    (`specdistill.data.long_prompts`); every row's `tokens` is its exact length, in its bucket."""
    buckets = [Bucket(*b) for b in s["buckets"]]
    tasks = ("complete", "question") if s["task"] == "both" else (s["task"],)
    candidates: dict[str, dict[str, list[int]]] = {b.name: {} for b in buckets}
    texts = dict(docs)
    cuts_of = {}
    for key, text in docs:
        cuts = document_cuts(text, s["kind"])
        if not cuts:
            continue
        cuts_of[key] = cuts
        approx = prefix_counter(text, tokenizer)
        for i, cut in enumerate(cuts):
            n = approx(cut.offset)
            for b in buckets:  # the question adds ~30 tokens: the exact count below decides
                if b.lo < n <= _top(b, s):
                    candidates[b.name].setdefault(key, []).append(i)
    per_bucket: dict[str, list[dict]] = {}
    for b in buckets:
        rng = random.Random(f"{s['seed']}:{b.name}")
        rows: list[dict] = []
        for key, i in round_robin(candidates[b.name], rng):
            if s["per_bucket"] is not None and len(rows) >= s["per_bucket"] * len(tasks):
                break
            text, cut = texts[key], cuts_of[key][i]
            rows.extend(_rows_at(text, key, cut, b, tasks, tokenizer, s, rng))
        per_bucket[b.name] = rows
    return interleave(per_bucket)


def _rows_at(
    text: str, key: str, cut, b: Bucket, tasks, tokenizer, s: dict[str, Any], rng
) -> list[dict]:
    """The rows of one cut (one per task), kept only where the exact length is in the bucket."""
    from specdistill.data.long_prompts import count_tokens

    prompt, continuation = split_at(text, cut)
    out = []
    for task in tasks:
        reference: str | None = continuation[: s["completion_chars"]]
        body = prompt
        if task == "question":
            qa = question_for(text, cut, rng)
            if qa is None:
                continue
            body, reference = prompt + qa[0], qa[1]
        n = count_tokens(body, tokenizer)
        if b.lo < n <= _top(b, s):
            out.append(
                {"prompt": body, "completion": reference, "bucket": b.name, "tokens": n}
                | {"module": key, "name": cut.name, "task": task, "offset": cut.offset}
            )
    return out


def _top(b: Bucket, s: dict[str, Any]) -> int:
    """The longest prompt bucket `b` takes: its HI, or `max_tokens` where that is lower."""
    return b.hi if s["max_tokens"] is None else min(b.hi, s["max_tokens"])


def tokenizer_digest(tokenizer: Any) -> str | None:
    """A digest of what decides token counts (the fast tokenizer's JSON), or None when the
    tokenizer is not a fast one (then rows are not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]


def cached_rows(
    s: dict[str, Any],
    split: str,
    tokenizer: Any,
    documents: Callable[[], list[tuple[str, str]]],
) -> list[dict[str, Any]]:
    """`long_rows` through the cache (settings + split + tokenizer digest + Python version)."""
    digest = tokenizer_digest(tokenizer)
    key = json.dumps([LONG_VERSION, s, split, digest, sys.version_info[:2]], sort_keys=True)
    if s["documents"] != "stdlib":  # a file's content decides too
        key += str(_source_stamp(s))
    path = (
        specdistill_home()
        / "long_prompts"
        / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.jsonl"
    )
    if digest and path.exists():
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    rows = long_rows(documents(), tokenizer, s)
    if digest:
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows


def _source_stamp(s: dict[str, Any]) -> tuple:
    path = s.get("path")
    if path and Path(str(path)).expanduser().exists():
        st = Path(str(path)).expanduser().stat()
        return (st.st_size, st.st_mtime_ns)
    return ()


def load_long_rows(cfg: Any, split: str, tokenizer: Any) -> list[dict[str, Any]]:
    """The `dataset.source=long` rows of `split` (train or test), checked and cached."""
    s = long_settings(cfg)
    if split not in ("train", "test"):
        raise ConfigError(f"dataset.split={split!r}: long prompt sets have splits train and test")
    if tokenizer is None:
        raise ConfigError(
            "dataset.source=long buckets prompts in the target's tokens: it needs the pair's "
            "tokenizer (call load_prompts(cfg.dataset, tokenizer))"
        )
    if s["documents"] == "stdlib":
        documents = lambda: stdlib_documents(split)  # noqa: E731
    else:
        documents = lambda: file_documents(s, split)  # noqa: E731
    rows = cached_rows(s, split, tokenizer, documents)
    if not rows:
        names = ", ".join(name for name, _, _ in s["buckets"])
        raise ConfigError(
            f"no {split}-split {s['documents']} document has a cut whose prompt lands in "
            f"dataset.buckets ({names}; max_tokens {s['max_tokens']}): choose shorter buckets "
            "or longer documents"
        )
    counts = {name: sum(r["bucket"] == name for r in rows) for name, _, _ in s["buckets"]}
    log.info("long prompts (%s, %s split): %s per bucket", s["documents"], split, counts)
    empty = [name for name, n in counts.items() if n == 0]
    if empty and rows:
        log.warning("no %s-split prompt lands in bucket(s) %s", split, ", ".join(empty))
    return rows


def census(rows: list[dict[str, Any]], buckets: list[tuple[str, int, int]]) -> dict[str, dict]:
    """Per bucket: prompts, distinct modules, and min / median / max prompt tokens."""
    out = {}
    for name, _, _ in buckets:
        lengths = sorted(r["tokens"] for r in rows if r["bucket"] == name)
        mid = lengths[len(lengths) // 2] if lengths else None
        out[name] = {
            "prompts": len(lengths),
            "modules": len({r["module"] for r in rows if r["bucket"] == name}),
            "tokens": [lengths[0], mid, lengths[-1]] if lengths else [],
        }
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m specdistill.data.long_documents TOKENIZER [split] [per_bucket|all] [task]`:
    how many prompts of each split land in each default bucket for a tokenizer (a folder)."""
    from transformers import AutoTokenizer

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit(main.__doc__)
    tok = AutoTokenizer.from_pretrained(args[0])
    split = args[1] if len(args) > 1 else "test"
    per = None if len(args) < 3 or args[2] == "all" else int(args[2])
    cfg = {"source": "long", "per_bucket": per, "max_tokens": 8192 - 128}
    cfg["task"] = args[3] if len(args) > 3 else "complete"
    rows = load_long_rows(cfg, split, tok)
    print(json.dumps(census(rows, long_settings(cfg)["buckets"]), indent=1))


if __name__ == "__main__":
    main()
