"""Target/drafter pairs: resolve the `pair` config, load the models, check their vocabularies.

Model names stay plain strings handed to `from_pretrained`; the toy world only fills them in
(building itself first) when `pair.toy` is set, and `pair.real` (a packaged GGUF model),
`.gguf` paths and `pair.drafter_layers` (a drafter built from the target) become cached
checkpoint folders (data/models/gguf.py, data/models/drafter_from_target.py). Vocabulary problems are caught here, before any
heavy work, with an error that names the field and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdistill.data.models.attention import check_attn_implementation, kernel_on
from specdistill.data.models.checkpoints import check_checkpoint_files
from specdistill.data.models.gguf import is_gguf
from specdistill.data.models.pair_vocab import check_pair_vocab, mapped_unsupported
from specdistill.data.models.tokenizer_identity import (
    TokenizerInfo,
    check_drafter_tokenizer,
    check_tokenizers,
)
from specdistill.data.runtime import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairSpec:
    """Where the target p, the drafter q and the tokenizer come from."""

    target: str
    drafter: str
    tokenizer: str
    revision: str | None = None
    drafter_revision: str | None = None
    trust_remote_code: bool = False
    toy: str | None = None
    real: str | None = None
    vocab: str = "shared"  # shared | mapped (pair.vocab resolved; data/models/pair_vocab.py)
    drafter_tokenizer: str | None = None  # mapped: where the drafter's own tokenizer loads from
    attn_implementation: str | None = None  # both models' kernel (data/models/attention.py)


def resolve_pair(pair: Any, *, stage: str = "this", mapped_ok: bool = False) -> PairSpec:
    """Turn a `pair` config node into concrete names/paths, building the toy world if asked.

    `pair.vocab` is resolved here from tokenizer files (data/models/pair_vocab.py). A stage that can
    run a drafter with its own tokenizer passes `mapped_ok=True`; any other stage is refused a
    mapped pair in one line naming `stage`, rather than running it as if the ids were shared.
    """
    get = pair.get if hasattr(pair, "get") else lambda k, d=None: getattr(pair, k, d)
    attention = check_attn_implementation(get("attn_implementation"))
    for field, name in named_folders(get):  # before the toy world or a conversion is built
        check_model_path(field, name)
    toy = get("toy")
    target, drafter, tokenizer = get("target"), get("drafter"), get("tokenizer")
    if toy:
        from specdistill.data.toy.world import ensure_toy_world

        world = ensure_toy_world(toy)
        if not get("real"):  # with a packaged target (pair=smollm2-toy) the world is the drafter's
            target = target or str(world.target_dir)
            tokenizer = tokenizer or str(world.target_dir)
        if get("drafter_layers") is None:  # else the drafter is built from the target
            drafter = drafter or str(world.drafter_dir)
    real, layers = get("real"), get("drafter_layers")
    if (
        real
        or layers is not None
        or any(str(n).lower().endswith(".gguf") for n in (target, drafter, tokenizer))
    ):
        # Packaged models, .gguf files and drafters built from the target's layers.
        from specdistill.data.models.drafter_from_target import resolve_built_pair

        target, drafter, tokenizer = resolve_built_pair(
            real=real,
            target=target,
            drafter=drafter,
            tokenizer=tokenizer,
            layers=layers,
            revision=get("revision"),
            trust_remote_code=bool(get("trust_remote_code", False)),
        )
    if not target:
        raise ConfigError("pair.target is empty: set it to a hub name or a local checkpoint path")
    if not drafter:
        raise ConfigError(
            "pair.drafter is empty: set it to a hub name or a local checkpoint path, "
            "or pair.drafter_layers (e.g. first:4) to build one from the target's layers"
        )
    for field, name in (("pair.target", target), ("pair.drafter", drafter)):
        check_model_path(field, name)
    # Weight files complete and tokenizers the same, from headers and tokenizer files only.
    check_checkpoint_files("pair.target", str(target))
    check_checkpoint_files("pair.drafter", str(drafter))
    vocab = check_pair_vocab(get, str(tokenizer or target), str(target), str(drafter))
    if vocab.mode == "mapped" and not mapped_ok:
        raise mapped_unsupported(stage, str(drafter), vocab)
    return PairSpec(
        target=str(target),
        drafter=str(drafter),
        tokenizer=str(tokenizer or target),
        revision=get("revision"),
        drafter_revision=get("drafter_revision"),
        trust_remote_code=bool(get("trust_remote_code", False)),
        toy=toy,
        real=real,
        vocab=vocab.mode,
        drafter_tokenizer=vocab.drafter_tokenizer,
        attn_implementation=attention,
    )


def named_folders(get: Any) -> list[tuple[str, str]]:
    """(field, name) of each model the pair names and `resolve_pair` reads as given: a name
    wins over what would be built for its role (the toy world's, the packaged target, a drafter
    cut from the target's layers), except a .gguf file, which is converted. The plan checks the
    same list (distill/pipeline/preflight_plan.py), so neither restates the other's rule."""
    named = ((role, get(role)) for role in ("target", "drafter"))
    return [(f"pair.{role}", str(name)) for role, name in named if name and not is_gguf(name)]


def check_model_path(field: str, name: str) -> None:
    """A local-looking path that does not exist is a typo, not a hub id: say so up front."""
    p = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or p.exists() or name.count("/") > 1
    if looks_local and not (p / "config.json").exists():
        what = "does not exist" if not p.exists() else "has no config.json"
        raise ConfigError(
            f"{field}={name!r} {what}: point it at a saved `transformers` checkpoint "
            "(a folder written by save_pretrained) or a hub model id"
        )


def load_tokenizer(spec: PairSpec):
    """The target's tokenizer, with a pad token guaranteed (left padding for decoder-only)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            spec.tokenizer, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    except OSError as e:
        raise ConfigError(f"pair.tokenizer={spec.tokenizer!r} could not be loaded: {e}") from e
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                f"the tokenizer of {spec.tokenizer!r} has neither a pad nor an EOS token: "
                "add a pad token to it (tokenizer.add_special_tokens) and save it"
            )
        log.warning(
            "tokenizer %s has no pad token; using its EOS token %r", spec.tokenizer, tok.eos_token
        )
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(
    name: str,
    *,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    field: str = "model",
    attn_implementation: str | None = None,
):
    """`AutoModelForCausalLM.from_pretrained` in eval mode, with a field-naming error, with the
    attention kernel `attn_implementation` (None: transformers' choice; data/models/attention.py)."""
    from transformers import AutoModelForCausalLM

    check_checkpoint_files(field, name)  # a truncated file is named before anything loads
    attention = kernel_on(attn_implementation, device, field)
    kernel = {"attn_implementation": attention} if attention else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, revision=revision, dtype=dtype, trust_remote_code=trust_remote_code, **kernel
        )
    except OSError as e:
        raise ConfigError(f"{field}={name!r} could not be loaded: {e}") from e
    return model.to(device).eval()


def load_role(spec: PairSpec, role: str, *, dtype: torch.dtype = torch.float32, device="cpu"):
    """The pair's `target` or `drafter`, with its own revision; errors name `pair.<role>`."""
    if role not in ("target", "drafter"):
        raise ValueError(f"role must be 'target' or 'drafter', not {role!r}")
    return load_model(
        getattr(spec, role),
        revision=spec.revision if role == "target" else spec.drafter_revision,
        dtype=dtype,
        device=device,
        trust_remote_code=spec.trust_remote_code,
        field=f"pair.{role}",
        attn_implementation=spec.attn_implementation,
    )


def load_pair(
    spec: PairSpec, *, device="cpu", dtype: torch.dtype = torch.float32, target: bool = True
):
    """(target or None, drafter, tokenizer): tokenizers compared before any weights load,
    then the vocabularies (logit rows) checked against each other. A mapped spec (the drafter
    has its own tokenizer) loads both models, each checked against its own tokenizer; the
    target's tokenizer is returned, the drafter's is `load_drafter_tokenizer(spec)`."""
    tok = load_tokenizer(spec)
    if spec.vocab == "mapped":  # its own tokenizer: no id check, the mapping is the decoder's
        d_tok = load_drafter_tokenizer(spec)
        for role in ("target", "drafter"):  # both files checked before either loads
            check_checkpoint_files(f"pair.{role}", getattr(spec, role))
        drafter = load_role(spec, "drafter", dtype=dtype, device=device)
        check_vocab(vocab_size(drafter), vocab_size(drafter), len(d_tok))
        tgt = load_role(spec, "target", dtype=dtype, device=device) if target else None
        if tgt is not None:
            check_vocab(vocab_size(tgt), vocab_size(tgt), len(tok))
        return tgt, drafter, tok
    if target:
        check_drafter_tokenizer(
            tok,
            spec.drafter,
            revision=spec.drafter_revision,
            target=spec.target,
            target_revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
        )
        for role in ("target", "drafter"):  # both files checked before either loads
            check_checkpoint_files(f"pair.{role}", getattr(spec, role))
    drafter = load_role(spec, "drafter", dtype=dtype, device=device)
    tgt = None
    if target:
        tgt = load_role(spec, "target", dtype=dtype, device=device)
        check_vocab(vocab_size(tgt), vocab_size(drafter), len(tok))
    else:
        check_vocab(vocab_size(drafter), vocab_size(drafter), len(tok))
    return tgt, drafter, tok


def load_drafter_tokenizer(spec: PairSpec):
    """A mapped drafter's own tokenizer (`spec.drafter_tokenizer`, its folder by default)."""
    from transformers import AutoTokenizer

    name = spec.drafter_tokenizer or spec.drafter
    try:
        return AutoTokenizer.from_pretrained(
            name, revision=spec.drafter_revision, trust_remote_code=spec.trust_remote_code
        )
    except OSError as e:
        raise ConfigError(
            f"pair.drafter={name!r}: its own tokenizer could not be loaded: {e}"
        ) from e


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def check_vocab(target_vocab: int, drafter_vocab: int, tokenizer_len: int) -> int:
    """The common vocabulary size both models' logits are brought to.

    Checkpoints often pad the embedding matrix to a multiple of 64/128: a drafter that differs
    from the target only in that padding (both cover every real token of the tokenizer) is fine,
    and its logits are padded with -inf or trimmed to the target's size. Anything else means
    the two models do not share a tokenizer and speculative decoding would be meaningless.
    """
    if tokenizer_len > target_vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer_len} tokens but pair.target has only {target_vocab} "
            "logits: set pair.tokenizer to the target's own tokenizer"
        )
    if tokenizer_len > drafter_vocab:
        raise ConfigError(
            f"target and drafter vocab sizes differ ({target_vocab} vs {drafter_vocab}) beyond "
            f"padding: the tokenizer has {tokenizer_len} tokens, more than the drafter covers. "
            "Choose a pair.drafter trained with the target's tokenizer"
        )
    return target_vocab


def match_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Pad (with -inf) or trim the last dim of drafter logits to the target's vocab size."""
    v = logits.shape[-1]
    if v == size:
        return logits
    if v > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def check_same_tokenizer(target_tok, drafter_tok, *, field: str = "pair.drafter") -> None:
    """Both tokenizers must be the same tokenizer (vocabulary, merges, added tokens); embedding
    padding rows aside. See `specdistill.data.models.tokenizer_identity`."""

    def info(tok):
        return TokenizerInfo.from_tokenizer(str(getattr(tok, "name_or_path", "") or "?"), tok)

    check_tokenizers(info(target_tok), info(drafter_tok), field_name=field)
