"""What each token of a tokenizer stands for, as bytes: the ground the vocabulary mapping stands on.

Two tokenizers spell the same text with different symbols: byte-level BPE (GPT-2, Llama 3,
SmolLM2) writes every byte as one printable character (space is `Ġ`, newline `Ċ`), SentencePiece
writes a space as `▁` and bytes it has no piece for as `<0xNN>`. Comparing token *strings*
therefore misses most of the shared vocabulary; comparing the *bytes* each token decodes to does
not. This module turns a tokenizer's `tokenizer.json` (the fast tokenizer's backend JSON) into a
`TokenTable`: canonical bytes per regular token, special tokens kept apart (they stand for a
role, not for text) and the bos/eos/unk/pad roles by id.

How a token's bytes are found, per token and without the sequence-level effects of decoding
(the first token's stripped leading space, `Fuse`): the decoder's steps are applied in order
(`ByteLevel`: the byte alphabet inverted; `Metaspace` and `Replace`: `▁` back to a space;
`ByteFallback`: `<0xNN>` to its byte; `BPEDecoder`: the end-of-word suffix to a space). A
tokenizer without a decoder is read from its pre-tokenizer (ByteLevel, Metaspace) and its
normalizer (a `Replace` of the space by a marker is undone). Normalizers such as NFKC or
lowercasing change which tokens the tokenizer can *produce*, not what a token stands for, so
they do not change the bytes; the coverage figure (vocab_mapping.py) measures what is produced.
Partial UTF-8 (a byte-level token holding half a character) is fine: bytes are compared, never
decoded text. Added tokens that are not special stand for their content as written (they are
matched against raw text before the model sees it).

WordPiece (BERT-style encoders) and CTC decoders have no byte meaning per token and are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("eos_token", "bos_token", "unk_token", "pad_token")  # role mapping order (first wins)
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Preference among tokens spelling the same bytes: the one the tokenizer emits for that text.
# Added tokens are split out of raw text first; SentencePiece uses a byte piece only when no
# regular piece covers the text.
KIND_ADDED, KIND_REGULAR, KIND_BYTE_FALLBACK = 0, 1, 2


class UnsupportedTokenizer(ValueError):
    """The tokenizer's tokens have no per-token byte meaning this module understands."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7F-0xA0,
    0xAD) are moved to U+0100 onwards in byte order, so every byte is one visible character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNBYTE = {c: b for b, c in byte_alphabet().items()}


def _bytelevel(value: str | bytes) -> bytes:
    """Byte-level characters back to bytes; characters outside the alphabet as their UTF-8
    (what the `tokenizers` ByteLevel decoder does with them)."""
    if isinstance(value, bytes):
        return value
    out = bytearray()
    for ch in value:
        b = _UNBYTE.get(ch)
        out.extend([b] if b is not None else ch.encode("utf-8"))
    return bytes(out)


def _replace(value: str | bytes, old: str, new: str) -> str | bytes:
    if isinstance(value, bytes):
        return value.replace(old.encode("utf-8"), new.encode("utf-8"))
    return value.replace(old, new)


def _pattern(step: dict) -> str:
    pat = step.get("pattern") or {}
    if "String" in pat:
        return str(pat["String"])
    raise UnsupportedTokenizer(f"a Replace step with a regex pattern ({pat})")


def _flatten(node: dict | None, key: str) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [s for sub in node.get(key) or [] for s in _flatten(sub, key)]
    return [node]


def decode_steps(data: dict) -> list[dict]:
    """The per-token decoding steps of a tokenizer.json: its decoder's, else inferred from the
    pre-tokenizer and normalizer (a tokenizer saved without a decoder still spells spaces with
    its marker)."""
    steps = _flatten(data.get("decoder"), "decoders")
    if steps:
        return steps
    inferred: list[dict] = []
    for node in _flatten(data.get("pre_tokenizer"), "pretokenizers"):
        if node.get("type") == "ByteLevel":
            inferred.append({"type": "ByteLevel"})
        elif node.get("type") == "Metaspace":
            inferred.append(node)
    for node in _flatten(data.get("normalizer"), "normalizers"):
        if node.get("type") == "Replace" and node.get("content") and _pattern(node) == " ":
            inferred.append(
                {"type": "Replace", "pattern": {"String": node["content"]}, "content": " "}
            )
    return inferred


def piece_bytes(piece: str, steps: list[dict]) -> bytes:
    """The bytes one regular token stands for, given its tokenizer's decoding steps."""
    value: str | bytes = piece
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            value = _bytelevel(value)
        elif kind == "Metaspace":
            value = _replace(value, str(step.get("replacement", "▁")), " ")
        elif kind == "Replace":
            value = _replace(value, _pattern(step), str(step.get("content", "")))
        elif kind == "ByteFallback":
            m = _BYTE_PIECE.match(value) if isinstance(value, str) else None
            if m:
                value = bytes([int(m.group(1), 16)])
        elif kind == "BPEDecoder":
            suffix = str(step.get("suffix", "</w>"))
            if isinstance(value, str) and value.endswith(suffix):
                value = value[: -len(suffix)] + " "
        elif kind in ("Fuse", "Strip"):
            continue  # sequence-level: joins tokens / strips the text's first characters
        else:
            raise UnsupportedTokenizer(f"its decoder step {kind!r} has no per-token byte meaning")
    return value if isinstance(value, bytes) else value.encode("utf-8")


@dataclass(frozen=True)
class TokenTable:
    """One tokenizer's vocabulary as data the mapping needs (ids of this tokenizer).

    `text` holds every id that stands for text (regular and non-special added tokens) with its
    bytes; `kind` ranks duplicates (KIND_*); `special` holds special tokens by content (never
    mapped as text); `roles` maps bos/eos/unk/pad to ids where the tokenizer has them.
    """

    name: str
    size: int  # largest id + 1: the logit rows the tokenizer needs
    text: dict[int, bytes]
    kind: dict[int, int]
    special: dict[int, str] = field(default_factory=dict)
    roles: dict[str, int] = field(default_factory=dict)

    def canonical(self) -> dict[bytes, int]:
        """bytes -> the id this tokenizer emits for them (added, regular, byte piece; then the
        lowest id): where two ids spell the same bytes, the other side maps to this one."""
        best: dict[bytes, int] = {}
        for i in sorted(self.text, key=lambda i: (self.kind[i], i)):
            best.setdefault(self.text[i], i)
        return best


def token_table(data: dict, roles: dict[str, str | None], name: str = "?") -> TokenTable:
    """A `TokenTable` from a parsed tokenizer.json and its role tokens (bos/eos/unk/pad contents,
    from tokenizer_config.json or the loaded tokenizer). Raises UnsupportedTokenizer."""
    model = data.get("model") or {}
    mtype = str(model.get("type"))
    if mtype in ("WordPiece", "WordLevel"):
        raise UnsupportedTokenizer(f"it is a {mtype} tokenizer (an encoder's, no byte meaning)")
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        pieces = {i: str(p[0]) for i, p in enumerate(vocab)}
    else:
        pieces = {int(i): str(t) for t, i in vocab.items()}
    steps = decode_steps(data)
    byte_fallback = any(s.get("type") == "ByteFallback" for s in steps) or bool(
        model.get("byte_fallback")
    )
    special: dict[int, str] = {}
    added: dict[int, str] = {}
    for t in data.get("added_tokens") or []:
        (special if t.get("special") else added)[int(t["id"])] = str(t["content"])
    unk = model.get("unk_token") if mtype != "Unigram" else None
    if mtype == "Unigram" and model.get("unk_id") is not None:
        unk = pieces.get(int(model["unk_id"]))
    text: dict[int, bytes] = {}
    kind: dict[int, int] = {}
    for i, piece in pieces.items():
        if i in special or i in added or piece == unk:
            if piece == unk and i not in added:
                special.setdefault(i, piece)  # the model's unknown piece stands for no text
            continue
        text[i] = piece_bytes(piece, steps)
        kind[i] = KIND_BYTE_FALLBACK if byte_fallback and _BYTE_PIECE.match(piece) else KIND_REGULAR
    for i, content in added.items():
        text[i], kind[i] = content.encode("utf-8"), KIND_ADDED
    by_content = {c: i for i, c in sorted(special.items(), reverse=True)}
    by_content.update({c: i for i, c in sorted(added.items(), reverse=True) if c not in by_content})
    by_piece = {p: i for i, p in sorted(pieces.items(), reverse=True)}
    role_ids = {}
    for role in ROLES:
        content = roles.get(role)
        if content is None:
            continue
        rid = by_content.get(content, by_piece.get(content))
        if rid is not None:
            role_ids[role] = rid
    ids = [*pieces, *special, *added]
    return TokenTable(name, max(ids, default=-1) + 1, text, kind, special, role_ids)


def role_contents(tokenizer_config: dict[str, Any]) -> dict[str, str | None]:
    """bos/eos/unk/pad token contents from a tokenizer_config.json (strings or AddedToken dicts)."""
    out: dict[str, str | None] = {}
    for role in ROLES:
        v = tokenizer_config.get(role)
        out[role] = v.get("content") if isinstance(v, dict) else (None if v is None else str(v))
    return out
