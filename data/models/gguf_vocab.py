"""A GGUF file's vocabulary as llama.cpp sees it, and llama.cpp's rule for pairing a drafter.

llama.cpp (`common/speculative.cpp`, `common_speculative_are_compatible`) serves a draft model
beside a target only when the two vocabularies agree on: the vocabulary type, the add-BOS flag
and (when BOS is added) the BOS id, the add-EOS flag and (when EOS is added) the EOS id, sizes
within 128 tokens of each other, and the same text for every token id from 5 up to the smaller
size. A drafter that fails is refused when the server starts (`--spec-type draft-simple`), or,
without `--spec-type`, loaded and never used. `compatibility_problems` applies the same rule to
two files' metadata before anything is written or started, so the export refuses a drafter in
one line instead of a server log.

Where a file leaves a flag or id out, llama.cpp derives it from the tokenizer model and its
pre-tokenizer; two files compared here with one of them silent are compared on those names too
(both silent with the same model and pre-tokenizer derive the same value), which is stricter
than llama.cpp only for files that state different pre-tokenizers yet derive equal flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# llama.cpp's limits (common/speculative.cpp): SPEC_VOCAB_MAX_SIZE_DIFFERENCE and
# SPEC_VOCAB_CHECK_START_TOKEN_ID.
MAX_SIZE_DIFFERENCE = 128
CHECK_START_TOKEN_ID = 5

# tokenizer.ggml.model -> llama.cpp's vocabulary type (llama_vocab_type), for the messages
VOCAB_TYPES = {
    "no_vocab": "none",
    "llama": "spm",
    "gpt2": "bpe",
    "bert": "wpm",
    "t5": "ugm",
    "rwkv": "rwkv",
    "plamo2": "plamo2",
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer fields llama.cpp's drafter check reads (None: the file does not say)."""

    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: tuple[str, ...]  # tokenizer.ggml.tokens, by id
    add_bos: bool | None = None
    add_eos: bool | None = None
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def vocab_type(self) -> str:
        return VOCAB_TYPES.get(self.model, self.model)


def gguf_reader(path: str | Path):
    """`gguf.GGUFReader` of the file, once per (path, size, mtime) in a process: it parses every
    array field (49k tokens and merges for SmolLM2) into numpy objects, seconds each time."""
    p = Path(path)
    st = p.stat()
    return _reader(str(p.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    """The vocabulary fields of a GGUF file."""
    reader = gguf_reader(path)

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    model = value("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{path}: no tokenizer.ggml.model (a GGUF file without a vocabulary)")
    tokens = value("tokenizer.ggml.tokens") or []
    return GGUFVocab(
        model=str(model),
        pre=value("tokenizer.ggml.pre"),
        tokens=tuple(str(t) for t in tokens),
        add_bos=_opt_bool(value("tokenizer.ggml.add_bos_token")),
        add_eos=_opt_bool(value("tokenizer.ggml.add_eos_token")),
        bos_id=_opt_int(value("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(value("tokenizer.ggml.eos_token_id")),
    )


def _opt_bool(v) -> bool | None:
    return None if v is None else bool(v)


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _flag_problem(name: str, target: GGUFVocab, draft: GGUFVocab) -> str | None:
    """The add-BOS / add-EOS rule: flags equal and, when added, the same token id."""
    t_add, d_add = getattr(target, f"add_{name}"), getattr(draft, f"add_{name}")
    t_id, d_id = getattr(target, f"{name}_id"), getattr(draft, f"{name}_id")
    upper = name.upper()
    if (t_add is None or d_add is None) and (t_add != d_add or target.pre != draft.pre):
        return (
            f"add-{upper} is left to llama.cpp's defaults by {_silent(t_add, d_add)} with "
            f"pre-tokenizers {target.pre!r} (target) and {draft.pre!r} (drafter), so the two "
            "may differ: state tokenizer.ggml.add_"
            f"{name}_token in both files"
        )
    if t_add != d_add:
        return f"the target adds {upper} ({t_add}) and the drafter does not agree ({d_add})"
    if (t_add or d_add) and t_id != d_id:
        return f"{upper} ids differ: target {t_id}, drafter {d_id}"
    return None


def _silent(t, d) -> str:
    return (
        "both files" if t is None and d is None else ("the target" if t is None else "the drafter")
    )


def compatibility_problems(target: GGUFVocab, draft: GGUFVocab) -> list[str]:
    """Why llama.cpp would refuse `draft` as a drafter of `target` (empty: it accepts it).

    The first differing token is named, not all of them: one is enough to refuse."""
    if target.vocab_type != draft.vocab_type:
        return [
            f"vocabulary types differ: target {target.model!r} ({target.vocab_type}), "
            f"drafter {draft.model!r} ({draft.vocab_type})"
        ]
    problems = [p for p in (_flag_problem(n, target, draft) for n in ("bos", "eos")) if p]
    n_t, n_d = len(target.tokens), len(draft.tokens)
    if abs(n_t - n_d) > MAX_SIZE_DIFFERENCE:
        problems.append(
            f"vocabulary sizes {n_t} (target) and {n_d} (drafter) differ by {abs(n_t - n_d)}, "
            f"more than llama.cpp's {MAX_SIZE_DIFFERENCE}"
        )
    for i in range(CHECK_START_TOKEN_ID, min(n_t, n_d)):
        if target.tokens[i] != draft.tokens[i]:
            problems.append(
                f"token {i} differs: target {target.tokens[i]!r}, drafter {draft.tokens[i]!r}"
            )
            break
    return problems
