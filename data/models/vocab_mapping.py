"""The vocabulary mapping between a target p and a drafter q with another tokenizer (TLI).

Token-level intersection (Timor et al., ICML 2025; what vLLM serves as
`use_heterogeneous_vocab`): the two vocabularies are intersected by the text each token stands
for, so the drafter q reads the target's tokens mapped to its ids, proposes only tokens in the
intersection, and its proposals are mapped back to target ids; verification stays exact because
q, restricted to the intersection and moved into the target's ids, is an ordinary distribution
over the target's vocabulary.

Tokens are compared by their canonical bytes (data/models/token_bytes.py), never by their spelling.
Special tokens map by role (eos, bos, unk, pad: in that order, the first mapping of an id wins)
and, where both tokenizers have a special token spelled identically, by that spelling; a special
token never maps to text. Where one side spells the same bytes with several ids (SentencePiece's
`▁` and `<0x20>`, an added token repeating a piece) every one of them maps, to the other side's
canonical id for those bytes (`TokenTable.canonical`), so both arrays may be many-to-one: move q
into target ids with a scatter-add over `draft_to_target`, not an inverse permutation.

Where ours differs from vLLM's `VocabMapping` (vllm/v1/spec_decode/vocab_mapping.py), which
matches `get_vocab()` strings after turning one detected space marker (`Ġ` or `▁`) into a space:
- bytes, not strings: `Ċ` (byte-level newline) matches SentencePiece's `<0x0A>`, byte-level `â`
  matches `<0xE2>`, and any `Ġ`/`▁` inside a token (not only the first) is a space. For two
  byte-level tokenizers (the toy drafter and SmolLM2) the results are the same regular pairs;
- special tokens: vLLM matches them as strings, also against a regular token spelled the same;
  ours maps them by role first (SmolLM2's eos `<|im_end|>` <- the toy drafter's eos
  `<|endoftext|>`), so a drafter's end of text proposes the target's;
- duplicates: vLLM keeps one id per string, whichever `get_vocab()` lists first; ours maps all of
  them, to the id the tokenizer emits;
- sizes: vLLM sizes the arrays by the models' logit rows; ours by the tokenizers' ids (rows past
  them are padding): `VocabMapping.resized` pads with -1 to a model's rows.

Built once per pair and cached under `$SPECDISTILL_HOME/vocab_maps/<key>`, the key a hash of both
tokenizers' files (tokenizer.json and the role tokens); the coverage on a text set is cached
beside it. CLI: `python -m specdistill.data.models.vocab_mapping --target T --drafter D`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdistill.data.io import atomic_write_json, build_once, read_json
from specdistill.data.models.token_bytes import (
    ROLES,
    TokenTable,
    UnsupportedTokenizer,
    role_contents,
)
from specdistill.data.models.token_bytes import token_table as _token_table
from specdistill.data.runtime import ConfigError, specdistill_home

MAPPING_VERSION = 1  # bump when the rules change what a mapping holds


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer as files: its tokenizer.json (parsed), role tokens and a content digest."""

    name: str
    data: dict
    roles: dict[str, str | None]
    digest: str

    @classmethod
    def from_json_text(cls, name: str, text: str, roles: dict[str, str | None]) -> TokenizerSource:
        blob = text.encode("utf-8") + json.dumps(roles, sort_keys=True).encode("utf-8")
        return cls(name, json.loads(text), roles, hashlib.sha256(blob).hexdigest())

    def table(self) -> TokenTable:
        try:
            return _token_table(self.data, self.roles, self.name)
        except UnsupportedTokenizer as e:
            raise ConfigError(
                f"the tokenizer {self.name!r} cannot be mapped by the text of its tokens: {e}; "
                "use a drafter with the target's tokenizer (pair.vocab=shared)"
            ) from e

    def backend(self):
        """The `tokenizers.Tokenizer` (for encoding texts; no `transformers` needed)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(json.dumps(self.data))


def read_source(folder: Path, name: str | None = None) -> TokenizerSource | None:
    """The tokenizer saved in a local folder (tokenizer.json + tokenizer_config.json), or None
    when it has no tokenizer.json; only these files are read."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    cfg_path = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        return TokenizerSource.from_json_text(
            name or str(folder), path.read_text(encoding="utf-8"), role_contents(cfg)
        )
    except ValueError as e:
        raise ConfigError(f"{path} or {cfg_path.name} is damaged ({e}): save it again") from e


def source_from_tokenizer(name: str, tok) -> TokenizerSource:
    """From a loaded `transformers` tokenizer (a hub name, a GGUF file): its backend JSON."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"the tokenizer {name!r} has no fast (tokenizers) backend to read its vocabulary "
            "from: save it as a fast tokenizer (tokenizer.json)"
        )
    roles = {r: getattr(tok, r, None) for r in ROLES}
    return TokenizerSource.from_json_text(name, backend.to_str(), {k: v for k, v in roles.items()})


# ------------------------------------------------------------------------------- the mapping


@dataclass(frozen=True)
class VocabMapping:
    """target p ids <-> drafter q ids; -1 where the token has no counterpart.

    intersection_size counts the drafter's ids that map (what q can propose: vLLM's figure);
    target_mapped the target's ids that map (what q can read).
    """

    target_to_draft: torch.Tensor  # long, [target tokenizer size]
    draft_to_target: torch.Tensor  # long, [drafter tokenizer size]
    target_name: str = "?"
    draft_name: str = "?"
    key: str = ""

    @property
    def target_vocab(self) -> int:
        return int(self.target_to_draft.numel())

    @property
    def draft_vocab(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def intersection_size(self) -> int:
        return int((self.draft_to_target >= 0).sum())

    @property
    def target_mapped(self) -> int:
        return int((self.target_to_draft >= 0).sum())

    def resized(self, target_rows: int, draft_rows: int) -> VocabMapping:
        """Both arrays brought to the models' logit rows (padding rows map to nothing)."""

        def fit(a: torch.Tensor, n: int) -> torch.Tensor:
            if n < a.numel():
                raise ValueError(f"{n} rows cannot hold a tokenizer of {a.numel()} ids")
            return torch.cat([a, a.new_full((n - a.numel(),), -1)])

        t2d = fit(self.target_to_draft, target_rows)
        return VocabMapping(t2d, fit(self.draft_to_target, draft_rows), *self._names())

    def _names(self) -> tuple[str, str, str]:
        return self.target_name, self.draft_name, self.key


def build_mapping(target: TokenTable, draft: TokenTable) -> VocabMapping:
    """The mapping of two token tables (pure): text by canonical bytes, specials by role, then
    by identical spelling (both special)."""
    t2d = np.full(target.size, -1, dtype=np.int64)
    d2t = np.full(draft.size, -1, dtype=np.int64)
    t_canon, d_canon = target.canonical(), draft.canonical()
    for i, b in target.text.items():
        t2d[i] = d_canon.get(b, -1)
    for i, b in draft.text.items():
        d2t[i] = t_canon.get(b, -1)
    pairs = [
        (target.roles[r], draft.roles[r]) for r in ROLES if r in target.roles and r in draft.roles
    ]
    d_special = {c: i for i, c in sorted(draft.special.items(), reverse=True)}
    t_special = {c: i for i, c in sorted(target.special.items(), reverse=True)}
    pairs += [(t_special[c], d_special[c]) for c in sorted(t_special) if c in d_special]
    for t, d in pairs:
        # A role held by a text token maps as text (above); a special id keeps its first role.
        if t not in target.text and t2d[t] < 0:
            t2d[t] = d
        if d not in draft.text and d2t[d] < 0:
            d2t[d] = t
    return VocabMapping(torch.from_numpy(t2d), torch.from_numpy(d2t), target.name, draft.name)


def mapping_key(target: TokenizerSource, draft: TokenizerSource) -> str:
    blob = f"v{MAPPING_VERSION}:{target.digest}:{draft.digest}".encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def cache_dir(target: TokenizerSource, draft: TokenizerSource) -> Path:
    return specdistill_home() / "vocab_maps" / mapping_key(target, draft)


def vocab_mapping(target: TokenizerSource, draft: TokenizerSource) -> VocabMapping:
    """The pair's mapping, built once and cached (atomically: `build_once`)."""
    key = mapping_key(target, draft)

    def build(tmp: Path) -> None:
        m = build_mapping(target.table(), draft.table())
        tmp.mkdir(parents=True)
        np.save(tmp / "target_to_draft.npy", m.target_to_draft.numpy())
        np.save(tmp / "draft_to_target.npy", m.draft_to_target.numpy())
        atomic_write_json(tmp / "mapping.json", summary(m) | {"key": key})

    root = build_once(cache_dir(target, draft), "mapping.json", build)
    t2d = torch.from_numpy(np.load(root / "target_to_draft.npy"))
    d2t = torch.from_numpy(np.load(root / "draft_to_target.npy"))
    return VocabMapping(t2d, d2t, target.name, draft.name, key)


def summary(m: VocabMapping) -> dict:
    return {
        "target": m.target_name,
        "drafter": m.draft_name,
        "target_vocab": m.target_vocab,
        "draft_vocab": m.draft_vocab,
        "intersection": m.intersection_size,
        "target_mapped": m.target_mapped,
        "version": MAPPING_VERSION,
    }


# ------------------------------------------------------------------------------- coverage


@dataclass(frozen=True)
class Coverage:
    """Of the target's tokens on a text set, the share the drafter can propose (in the map)."""

    tokens: int
    covered: int
    unmapped_top: list[tuple[int, str, int]]  # (target id, token spelling, count), by count

    @property
    def share(self) -> float:
        return self.covered / self.tokens if self.tokens else 0.0


def coverage_of(mapping: VocabMapping, target_ids: list[list[int]], spell) -> Coverage:
    """Coverage of the target's token id sequences (pure); `spell(id)` names a token."""
    counts = Counter(i for seq in target_ids for i in seq)
    t2d = mapping.target_to_draft
    covered = sum(c for i, c in counts.items() if i < t2d.numel() and t2d[i] >= 0)
    missing = [(i, c) for i, c in counts.items() if not (i < t2d.numel() and t2d[i] >= 0)]
    missing.sort(key=lambda ic: (-ic[1], ic[0]))
    top = [(i, spell(i), c) for i, c in missing[:10]]
    return Coverage(sum(counts.values()), covered, top)


def coverage(mapping: VocabMapping, target: TokenizerSource, texts: list[str]) -> Coverage:
    """The target's tokenization of `texts` (no special tokens added), cached per text set
    beside the mapping."""
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()[:16]
    path = specdistill_home() / "vocab_maps" / mapping.key / f"coverage-{digest}.json"
    if mapping.key and path.is_file():
        d = read_json(path)
        return Coverage(d["tokens"], d["covered"], [tuple(x) for x in d["unmapped_top"]])
    tok = target.backend()
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    cov = coverage_of(mapping, ids, lambda i: tok.id_to_token(i) or "?")
    if mapping.key:
        atomic_write_json(
            path,
            {
                "tokens": cov.tokens,
                "covered": cov.covered,
                "share": cov.share,
                "texts": len(texts),
                "unmapped_top": [list(x) for x in cov.unmapped_top],
            },
        )
    return cov


def default_texts() -> list[str]:
    """The toy world's held-out code prompts with their completions (the coverage figure
    of data/RESULTS.md, "Vocabulary mapping coverage"): extracted from the stdlib in seconds,
    without building any model."""
    from specdistill.data.toy.world import toy_prompts

    return [r["prompt"] + r.get("completion", "") for r in toy_prompts("toy", "test")]


def load_source(
    name: str, *, field: str, revision: str | None = None, trust_remote_code: bool = False
) -> TokenizerSource | None:
    """A tokenizer by name: a local folder (its files; None when it has no tokenizer files), a
    toy world (`toy`, `toy-tiny`: its tokenizer, trained alone if the world is not built), a
    packaged model (`smollm2`) or a `.gguf` file (the tokenizer in the GGUF header, no weights
    read), else a hub name (`AutoTokenizer`: tokenizer files only)."""
    from specdistill.data.models.checkpoints import local_folder
    from specdistill.data.models.gguf import PACKAGED, is_gguf, packaged_gguf
    from specdistill.data.models.tokenizer_identity import has_tokenizer_files
    from specdistill.data.toy.world import SPECS, toy_tokenizer_dir

    folder = local_folder(name)
    if folder is not None:
        src = read_source(folder, name)
        if src is not None or not has_tokenizer_files(folder):
            return src
    elif name in SPECS:
        return read_source(toy_tokenizer_dir(name), name)
    from transformers import AutoTokenizer

    kwargs: dict = {"revision": revision, "trust_remote_code": trust_remote_code}
    where = name
    if name in PACKAGED or is_gguf(name):
        path = packaged_gguf(name, field) if name in PACKAGED else Path(name).expanduser()
        where, kwargs = str(path.parent), {"gguf_file": path.name}
    try:
        return source_from_tokenizer(name, AutoTokenizer.from_pretrained(where, **kwargs))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}={name!r}: its tokenizer could not be loaded ({e})") from e


def read_texts(spec: str | None) -> list[str]:
    """--prompts: a jsonl file (prompt [+ completion] per row), a toy split (`toy:test`), or
    None for `default_texts()`."""
    if not spec:
        return default_texts()
    if spec.startswith("toy"):
        from specdistill.data.toy.world import toy_prompts

        name, _, split = spec.partition(":")
        return [r["prompt"] + r.get("completion", "") for r in toy_prompts(name, split or "test")]
    rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    return [str(r.get("prompt", "")) + str(r.get("completion", "")) for r in rows]


def main(argv: list[str] | None = None) -> None:
    """Print a pair's mapping figures: sizes, intersection, coverage, unmapped frequent tokens."""
    import argparse

    from specdistill.data.runtime import run_or_exit

    ap = argparse.ArgumentParser(
        prog="python -m specdistill.data.models.vocab_mapping", description=main.__doc__
    )
    ap.add_argument(
        "--target", required=True, help="folder, hub name, .gguf, smollm2, toy, toy-tiny"
    )
    ap.add_argument("--drafter", required=True, help="the same kinds of name as --target")
    ap.add_argument(
        "--prompts",
        default=None,
        help="jsonl (prompt, completion) or toy:SPLIT; "
        "default: the toy world's held-out code prompts with completions",
    )
    args = ap.parse_args(argv)

    def run(_: object) -> dict:
        t = load_source(args.target, field="--target")
        d = load_source(args.drafter, field="--drafter")
        if t is None or d is None:
            raise ConfigError(f"{'--target' if t is None else '--drafter'} has no tokenizer files")
        m = vocab_mapping(t, d)
        cov = coverage(m, t, read_texts(args.prompts))
        print(f"target  {t.name}: {m.target_vocab} tokens, {m.target_mapped} of them mapped")
        print(f"drafter {d.name}: {m.draft_vocab} tokens")
        share = m.intersection_size / max(m.draft_vocab, 1)
        print(f"intersection: {m.intersection_size} drafter tokens ({share:.1%} of its vocabulary)")
        print(
            f"coverage: {cov.covered} of the target's {cov.tokens} tokens on the prompts "
            f"({cov.share:.1%}) are in the intersection"
        )
        print(
            "unmapped frequent target tokens: "
            + ", ".join(f"{tok!r} (id {i}, {c}x)" for i, tok, c in cov.unmapped_top[:8])
        )
        print(f"cache: {specdistill_home() / 'vocab_maps' / m.key}")
        return summary(m) | {"coverage": cov.share}

    run_or_exit(run, None)


if __name__ == "__main__":
    main()
