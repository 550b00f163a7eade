"""`pair.vocab`: whether the drafter q shares the target p's tokenizer or decodes through a mapping.

- `shared`: the drafter must use the target's tokenizer (data/models/tokenizer_identity.py); another
  tokenizer is one `error:` line, as before this setting existed.
- `mapped`: the drafter may have its own tokenizer; the vocabulary mapping (vocab_mapping.py) is
  built from the two tokenizers' files, and the pair is refused in one line only when no token is
  shared or the coverage (the share of the target's tokens on `pair.coverage_prompts` that the
  drafter can propose) is below `pair.min_vocab_coverage`: acceptance cannot exceed it.
- `auto` (the default): shared when the two tokenizers are the same, mapped otherwise.

Everything here reads tokenizer files only, before any weight: a hopeless pair costs seconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.models.checkpoints import local_folder
from specdistill.data.models.tokenizer_identity import (
    TokenizerInfo,
    check_local_tokenizers,
    check_tokenizers,
    tokenizer_differences,
)
from specdistill.data.models.vocab_mapping import (
    TokenizerSource,
    VocabMapping,
    coverage,
    load_source,
    read_texts,
    vocab_mapping,
)
from specdistill.data.runtime import ConfigError

log = logging.getLogger(__name__)

VOCAB_MODES = ("shared", "mapped", "auto")
# Below half of the target's tokens reachable, TLI acceptance is at most 0.5 and in practice
# well below it, where a same-tokenizer drafter cut from the target does as well with no
# mapping. Lower it to try a pair anyway.
DEFAULT_MIN_COVERAGE = 0.5


@dataclass(frozen=True)
class PairVocab:
    """The resolved mode (`shared` or `mapped`) and, for mapped, what later stages load."""

    mode: str
    drafter_tokenizer: str | None = None
    intersection: int | None = None
    coverage: float | None = None


def vocab_settings(get: Any) -> tuple[str, float, str | None]:
    """(pair.vocab, pair.min_vocab_coverage, pair.coverage_prompts), checked."""
    mode = get("vocab") or "auto"
    if mode not in VOCAB_MODES:
        raise ConfigError(
            f"pair.vocab={mode!r} is not a vocabulary mode; use shared (the drafter has the "
            "target's tokenizer), mapped (its own tokenizer, through a vocabulary mapping) or auto"
        )
    raw = get("min_vocab_coverage")
    try:
        threshold = DEFAULT_MIN_COVERAGE if raw is None else float(raw)
    except (TypeError, ValueError):
        threshold = -1.0
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(
            f"pair.min_vocab_coverage={raw!r} must be a share from 0 to 1 (default "
            f"{DEFAULT_MIN_COVERAGE}: the least share of the target's tokens the drafter can propose)"
        )
    prompts = get("coverage_prompts")
    return str(mode), threshold, None if prompts is None else str(prompts)


def _same(t: TokenizerSource, d: TokenizerSource) -> bool:
    """The same tokenizer as data (ids, merges, added tokens); role differences only warn."""
    if t.digest == d.digest:
        return True
    p = TokenizerInfo.from_json(t.name, t.data, dict(t.roles))
    q = TokenizerInfo.from_json(d.name, d.data, dict(d.roles))
    if tokenizer_differences(p, q)[0]:
        return False
    check_tokenizers(p, q)  # logs the warnings
    return True


def check_pair_vocab(get: Any, tokenizer: str, target: str, drafter: str) -> PairVocab:
    """Resolve `pair.vocab` for a pair whose names are resolved (tokenizer files only)."""
    mode, threshold, prompts = vocab_settings(get)
    if mode == "shared":
        check_local_tokenizers(tokenizer, target, drafter)
        return PairVocab("shared")
    trust = bool(get("trust_remote_code", False))
    try:
        d_src = load_source(
            drafter, field="pair.drafter", revision=get("drafter_revision"), trust_remote_code=trust
        )
        t_src = load_source(
            tokenizer, field="pair.tokenizer", revision=get("revision"), trust_remote_code=trust
        )
    except ConfigError:
        if mode == "mapped" or local_folder(drafter) is not None:
            raise
        d_src = t_src = None  # a hub name not reachable now: load_pair checks it as shared
    if d_src is None and mode == "mapped":
        raise ConfigError(
            f"pair.vocab=mapped: pair.drafter={drafter!r} has no tokenizer.json, and a mapped "
            "drafter decodes through its own tokenizer: save it beside the drafter's weights"
        )
    if d_src is None or t_src is None or (mode == "auto" and _same(t_src, d_src)):
        check_local_tokenizers(tokenizer, target, drafter)  # bare drafters, role warnings
        return PairVocab("shared")
    mapping = vocab_mapping(t_src, d_src)
    if mapping.intersection_size == 0:
        raise ConfigError(
            f"pair.drafter={drafter!r} shares no token with pair.target's tokenizer "
            f"{tokenizer!r} (pair.vocab={mode}: {mapping.draft_vocab} vs {mapping.target_vocab} "
            "tokens, none spelling the same text): choose a drafter whose tokenizer overlaps "
            "the target's"
        )
    texts = _coverage_texts(prompts)
    cov = coverage(mapping, t_src, texts)
    figures = (
        f"{mapping.intersection_size} of the drafter's {mapping.draft_vocab} tokens are in the "
        f"target's vocabulary; they cover {cov.share:.1%} of the target's {cov.tokens} tokens "
        f"on {prompts or 'the toy code prompts'}"
    )
    if cov.share < threshold:
        raise ConfigError(
            f"pair.drafter={drafter!r} has another tokenizer than pair.target and too little "
            f"in common (pair.vocab={mode}): {figures}, below pair.min_vocab_coverage="
            f"{threshold}. Choose a drafter whose vocabulary covers the target's text, or "
            "lower pair.min_vocab_coverage"
        )
    log.info("pair.vocab=%s -> mapped: %s", mode, figures)
    return PairVocab("mapped", drafter, mapping.intersection_size, cov.share)


def _coverage_texts(prompts: str | None) -> list[str]:
    if prompts and not prompts.startswith("toy") and not Path(prompts).expanduser().is_file():
        raise ConfigError(
            f"pair.coverage_prompts={prompts!r} does not exist: point it at a jsonl file with a "
            "`prompt` field (and optionally `completion`), or toy:test, or null"
        )
    try:
        texts = read_texts(prompts)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"pair.coverage_prompts={prompts!r} could not be read: {e}") from e
    if not any(t.strip() for t in texts):
        raise ConfigError(f"pair.coverage_prompts={prompts!r} holds no text")
    return texts


def mapped_unsupported(stage: str, drafter: str, vocab: PairVocab) -> ConfigError:
    """The one line a stage that cannot yet run a mapped pair ends with (never run as shared)."""
    return ConfigError(
        f"pair.drafter={drafter!r} has its own tokenizer (pair.vocab resolved to mapped: "
        f"{vocab.intersection} shared tokens, coverage {vocab.coverage:.1%}), but the "
        f"mapped-vocabulary drafter is not supported by the {stage} stage yet (it has no "
        "vocabulary-mapped path): "
        "choose a drafter that uses the target's tokenizer"
    )


def resolves_to_mapped(pair: Any) -> bool:
    """For an orchestrator, before any stage runs: True where the pair is known now to decode
    through a mapping: `pair.vocab=mapped`, or `auto` with both tokenizers in local folders and
    different (cheap to compare). Anything else is left to the stages, which resolve the pair
    and refuse what they cannot run."""
    get = pair.get if hasattr(pair, "get") else lambda k, d=None: getattr(pair, k, d)
    mode, _, _ = vocab_settings(get)
    if mode != "auto":
        return mode == "mapped"
    drafter, tok = get("drafter"), get("tokenizer") or get("target")
    if not drafter:
        return False
    if not tok and get("toy") and not get("real"):  # the toy world's tokenizer, models unbuilt
        from specdistill.data.toy.world import toy_tokenizer_dir

        tok = str(toy_tokenizer_dir(str(get("toy"))))
    if not tok:
        return False
    d_dir, t_dir = local_folder(str(drafter)), local_folder(str(tok))
    if d_dir is None or t_dir is None:
        return False
    from specdistill.data.models.vocab_mapping import read_source

    d, t = read_source(d_dir, str(drafter)), read_source(t_dir, str(tok))
    return d is not None and t is not None and not _same(t, d)


def pair_mapping(spec: Any) -> VocabMapping:
    """The vocabulary mapping of a resolved mapped pair (a `PairSpec`), from tokenizer files
    (built once per pair and cached: vocab_mapping.py)."""
    trust = bool(spec.trust_remote_code)
    t = load_source(
        spec.tokenizer, field="pair.tokenizer", revision=spec.revision, trust_remote_code=trust
    )
    d = load_source(
        spec.drafter_tokenizer or spec.drafter,
        field="pair.drafter",
        revision=spec.drafter_revision,
        trust_remote_code=trust,
    )
    if t is None or d is None:
        which = "pair.tokenizer" if t is None else "pair.drafter"
        raise ConfigError(f"{which} has no tokenizer.json to build the vocabulary mapping from")
    return vocab_mapping(t, d)
