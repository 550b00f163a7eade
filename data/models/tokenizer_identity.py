"""Tokenizer identity: the drafter q must use the target p's tokenizer, checked before weights.

Not merely at least as many logit rows: both tokenizers are compared as data (the
`tokenizer.json` model, vocabulary id by id, merges and added tokens); rows past the
tokenizer's length are embedding padding and are fine once the real tokens are the same tokens.
A mismatch is one `error:` line naming both tokenizers and what differs. Added tokens one side
lacks, another bos/eos/unk role or pre-tokenizer are warnings. A drafter without tokenizer
files is accepted, with a warning saying what was assumed, only when its config agrees with the
target's tokenizer (no more rows than the target, the same special ids); otherwise nothing
tells padding from another vocabulary, and it is refused.

Local folders are read directly (`check_local_tokenizers`, from `pairs.resolve_pair`); hub
names are checked by `pairs.load_pair` from the loaded tokenizers (`check_drafter_tokenizer`),
cheap next to the weights, before the weights are fetched.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.data.models.checkpoints import local_folder
from specdistill.data.runtime import ConfigError

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_ROLES = ("bos_token", "eos_token", "unk_token")
_warned: set[str] = set()


def _warn_once(msg: str, *args: Any) -> None:
    """resolve_pair and load_pair both check a pair: say each finding once per process."""
    text = msg % args
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


@dataclass
class TokenizerInfo:
    """A tokenizer as plain data: what speculative decoding relies on (id <-> token string)."""

    name: str
    model: str  # BPE | Unigram | WordPiece | WordLevel | a slow tokenizer's class name
    tokens: dict[int, str]  # every id, added tokens included
    added: set[int] = field(default_factory=set)  # ids of added (usually special) tokens
    merges: list[tuple[str, ...]] | None = None
    roles: dict[str, str | None] = field(default_factory=dict)  # bos/eos/unk token strings
    pre: str = ""  # normalizer + pre-tokenizer, canonical JSON

    @property
    def rows(self) -> int:
        """Logit rows the tokenizer needs: its largest id + 1."""
        return max(self.tokens, default=-1) + 1

    @classmethod
    def from_json(cls, name: str, data: dict, roles: dict[str, str | None]) -> TokenizerInfo:
        model = data.get("model") or {}
        vocab = model.get("vocab") or {}
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
            tokens = {i: str(piece[0]) for i, piece in enumerate(vocab)}
        else:
            tokens = {int(i): str(t) for t, i in vocab.items()}
        added = set()
        for t in data.get("added_tokens") or []:
            tokens[int(t["id"])] = str(t["content"])
            added.add(int(t["id"]))
        merges = model.get("merges")
        if merges is not None:
            merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
        pre = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")], sort_keys=True)
        return cls(name, str(model.get("type")), tokens, added, merges, roles, pre)

    @classmethod
    def from_tokenizer(cls, name: str, tok: Any) -> TokenizerInfo:
        """From a loaded `transformers` tokenizer (fast: its backend's JSON; slow: get_vocab)."""
        roles = {r: _token_str(getattr(tok, r, None)) for r in _ROLES}
        if getattr(tok, "is_fast", False):
            return cls.from_json(name, json.loads(tok.backend_tokenizer.to_str()), roles)
        tokens = {int(i): str(t) for t, i in tok.get_vocab().items()}
        added = {int(i) for i in getattr(tok, "added_tokens_decoder", {}) or {}}
        return cls(name, type(tok).__name__, tokens, added, None, roles)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return None if value is None else str(value)


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _TOKENIZER_FILES)


def read_tokenizer(folder: Path, name: str | None = None) -> TokenizerInfo | None:
    """The tokenizer saved in a local folder (None when it has none), read cheaply.

    tokenizer.json is read as JSON; a folder with only slow-tokenizer files is loaded with
    AutoTokenizer (still no weights).
    """
    name = name or str(folder)
    if not has_tokenizer_files(folder):
        return None
    cfg_path = folder / "tokenizer_config.json"
    try:
        tcfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{cfg_path} is damaged ({e}): save the tokenizer again") from e
    if (folder / "tokenizer.json").is_file():
        try:
            data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{folder / 'tokenizer.json'} is damaged ({e})") from e
        return TokenizerInfo.from_json(name, data, {r: _token_str(tcfg.get(r)) for r in _ROLES})
    from transformers import AutoTokenizer

    try:
        return TokenizerInfo.from_tokenizer(name, AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer in {folder} could not be loaded: {e}") from e


def _examples(pairs: list[tuple[int, str, str]]) -> str:
    return ", ".join(f"id {i}: {a!r} vs {b!r}" for i, a, b in pairs[:2])


def tokenizer_differences(p: TokenizerInfo, q: TokenizerInfo) -> tuple[list[str], list[str]]:
    """(errors, warnings) comparing the target's tokenizer p with the drafter's q."""
    errors: list[str] = []
    warnings: list[str] = []
    if p.model != q.model and p.merges is not None and q.merges is not None:
        errors.append(f"tokenizer models differ ({p.model} vs {q.model})")
    shared = sorted(set(p.tokens) & set(q.tokens))
    moved = [(i, p.tokens[i], q.tokens[i]) for i in shared if p.tokens[i] != q.tokens[i]]
    if moved:
        errors.append(
            f"{len(moved)} of {len(shared)} shared ids map to other tokens ({_examples(moved)})"
        )
    for who, a, b in (("drafter", q, p), ("target", p, q)):
        extra = sorted(set(a.tokens) - set(b.tokens))
        if not extra:
            continue
        regular = [i for i in extra if i not in a.added]
        if regular:
            errors.append(
                f"the {who}'s tokenizer has {len(regular)} regular tokens the other lacks "
                f"(ids {regular[0]}..{regular[-1]}, e.g. {a.tokens[regular[0]]!r})"
            )
        else:
            warnings.append(
                f"the {who}'s tokenizer adds {len(extra)} tokens at ids {extra[0]}..{extra[-1]} "
                f"(e.g. {a.tokens[extra[0]]!r}) that the other lacks"
            )
    if p.merges is not None and q.merges is not None and p.merges != q.merges:
        first = next(
            (k for k, (a, b) in enumerate(zip(p.merges, q.merges)) if a != b),
            min(len(p.merges), len(q.merges)),
        )
        a = " ".join(p.merges[first]) if first < len(p.merges) else "(none)"
        b = " ".join(q.merges[first]) if first < len(q.merges) else "(none)"
        errors.append(
            f"BPE merges differ ({len(p.merges)} vs {len(q.merges)}; first at #{first}: "
            f"{a!r} vs {b!r})"
        )
    for role in _ROLES:
        a, b = p.roles.get(role), q.roles.get(role)
        if a and b and a != b:
            warnings.append(f"{role} is {a!r} for the target, {b!r} for the drafter")
    if p.pre and q.pre and p.pre != q.pre and not errors:
        warnings.append("the normalizer or pre-tokenizer differs (the same ids, other splits)")
    return errors, warnings


def check_tokenizers(
    p: TokenizerInfo, q: TokenizerInfo, *, field_name: str = "pair.drafter"
) -> None:
    """One `error:` line naming both tokenizers and what differs; warnings are logged."""
    errors, warnings = tokenizer_differences(p, q)
    if errors:
        raise ConfigError(
            f"{field_name}={q.name!r} uses a different tokenizer than pair.target "
            f"(tokenizer {p.name!r}): {'; '.join(errors)}. Speculative decoding compares token "
            "ids: choose a drafter trained with the target's tokenizer"
        )
    for w in warnings:
        _warn_once("%s=%s: %s (the target's is used)", field_name, q.name, w)


def _config_ids(cfg: dict, key: str) -> set[int]:
    v = cfg.get(key)
    if v is None:
        return set()
    return {int(x) for x in (v if isinstance(v, list) else [v])}


def text_config(cfg: dict) -> dict:
    """The language model's part of a (possibly multimodal) config.json dict."""
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict) and "vocab_size" in cfg[key]:
            return cfg[key]
    return cfg


def check_bare_drafter(
    p: TokenizerInfo,
    drafter_cfg: dict,
    target_cfg: dict | None,
    *,
    drafter_name: str,
    field_name: str = "pair.drafter",
) -> None:
    """A drafter saved without a tokenizer: accepted only if its config agrees with p's.

    Its rows must cover p's tokens and be no more than the target's own (a larger vocabulary
    could be another tokenizer or padding, and nothing tells which); the special ids its
    config names must be p's.
    """
    dcfg, tcfg = text_config(drafter_cfg), text_config(target_cfg or {})
    rows = dcfg.get("vocab_size")
    target_rows = tcfg.get("vocab_size") or p.rows
    problems = []
    if rows is not None and not p.rows <= int(rows) <= max(int(target_rows), p.rows):
        problems.append(
            f"vocab_size {rows}, where the target's tokenizer has {p.rows} tokens and the "
            f"target {target_rows} rows"
        )
    ids = {tok: i for i, tok in p.tokens.items()}
    for key, role in (("eos_token_id", "eos_token"), ("bos_token_id", "bos_token")):
        mine = _config_ids(dcfg, key) or _config_ids(drafter_cfg, key)
        theirs = _config_ids(tcfg, key) | (
            {ids[p.roles[role]]} if p.roles.get(role) in ids else set()
        )
        if mine and theirs and not mine & theirs:
            problems.append(f"{key} {sorted(mine)} vs {sorted(theirs)}")
    if problems:
        raise ConfigError(
            f"{field_name}={drafter_name!r} has no tokenizer files and its config does not match "
            f"pair.target's tokenizer {p.name!r} ({'; '.join(problems)}): nothing tells padding "
            "rows from another vocabulary. Save the drafter's own tokenizer beside its weights, "
            "or copy the target's tokenizer files there if it was trained with them"
        )
    _warn_once(
        "%s=%s has no tokenizer files: assuming it uses pair.target's tokenizer %s (%d tokens; "
        "its config agrees: vocab_size %s, eos %s)",
        field_name,
        drafter_name,
        p.name,
        p.rows,
        rows,
        sorted(_config_ids(dcfg, "eos_token_id")) or "unset",
    )


def _read_config(folder: Path) -> dict | None:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ConfigError(f"{path} is damaged ({e}): save the checkpoint again") from e


def check_local_tokenizers(
    tokenizer: str, target: str, drafter: str, *, field_name: str = "pair.drafter"
) -> None:
    """Tokenizer identity when the tokenizer and the drafter are local folders (files only).

    Hub names are skipped here: `pairs.load_pair` checks them from the loaded tokenizers.
    """
    tok_dir, t_dir, d_dir = local_folder(tokenizer), local_folder(target), local_folder(drafter)
    if tok_dir is None or d_dir is None:
        return
    p = read_tokenizer(tok_dir, tokenizer)
    if p is None:
        return  # load_tokenizer says what is missing
    q = read_tokenizer(d_dir, drafter)
    if q is not None:
        check_tokenizers(p, q, field_name=field_name)
        return
    dcfg = _read_config(d_dir)
    if dcfg is not None:
        tcfg = _read_config(t_dir) if t_dir is not None else None
        check_bare_drafter(p, dcfg, tcfg, drafter_name=drafter, field_name=field_name)


def _config_dict(name: str, revision: str | None, trust_remote_code: bool) -> dict | None:
    folder = local_folder(name)
    if folder is not None:
        return _read_config(folder)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(
            name, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError):
        return None  # from_pretrained says why, with the field, when the weights load
    return cfg.to_dict()


def check_drafter_tokenizer(
    target_tok: Any,
    drafter: str,
    *,
    revision: str | None = None,
    target: str | None = None,
    target_revision: str | None = None,
    trust_remote_code: bool = False,
    field_name: str = "pair.drafter",
) -> None:
    """The drafter's tokenizer (local or hub) against the target's loaded one, before weights.

    Only tokenizer and config files are read (downloaded, for a hub name).
    """
    p = TokenizerInfo.from_tokenizer(
        str(getattr(target_tok, "name_or_path", "") or "?"), target_tok
    )
    folder = local_folder(drafter)
    q = None
    if folder is not None:
        q = read_tokenizer(folder, drafter)
    else:
        from transformers import AutoTokenizer

        try:
            q = TokenizerInfo.from_tokenizer(
                drafter,
                AutoTokenizer.from_pretrained(
                    drafter, revision=revision, trust_remote_code=trust_remote_code
                ),
            )
        except (OSError, ValueError):
            q = None
    if q is not None:
        check_tokenizers(p, q, field_name=field_name)
        return
    dcfg = _config_dict(drafter, revision, trust_remote_code)
    if dcfg is None:
        return
    tcfg = _config_dict(target, target_revision, trust_remote_code) if target else None
    check_bare_drafter(p, dcfg, tcfg, drafter_name=drafter, field_name=field_name)
