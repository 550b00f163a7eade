"""`export.gguf`: the drafter as GGUF files beside the checkpoint, for llama.cpp.

llama.cpp's server takes a draft model as a GGUF file (`llama-server -m TARGET.gguf -md
DRAFT.gguf --spec-type draft-simple --spec-draft-n-max K`) and pairs it with the target only if
their vocabularies pass its rule (data/models/gguf_vocab.py). The export writes the aligned
drafter (rows padded to the target's, head as exported) once per requested type, the
vocabulary copied from the target's GGUF file, and checks each file against the target's GGUF
before the folder is published. A drafter with its own tokenizer is refused up front: llama.cpp
has no vocabulary mapping.

Types: `f16`, `q8_0`, ... (data/models/gguf_writer.QUANT_TYPES) for every matrix, or `target`:
the target file's own recipe tensor role by role (SmolLM2's Q4_1 layers and Q8_0 embeddings).
A drafter step in llama.cpp streams its weights once per token, so a drafter quantised like the
target costs the target's bytes per parameter and no more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.models.gguf_writer import TARGET_RECIPE
from specdistill.data.runtime import ConfigError, required


@dataclass(frozen=True)
class GGUFSettings:
    """`gguf.*` of conf/export.yaml."""

    enabled: bool
    types: tuple[str, ...]  # f16, q8_0, ... (gguf_writer.QUANT_TYPES) or `target`
    target: str | None  # the target's GGUF; None: the pair's own file, or one written

    @classmethod
    def from_node(cls, node: Any) -> GGUFSettings:
        """The node checked and typed; a ConfigError names the field."""
        from specdistill.data.models.gguf_writer import QUANT_TYPES

        enabled = required(node, "enabled", "gguf")
        if not isinstance(enabled, bool):
            raise ConfigError(f"gguf.enabled={enabled!r} must be true or false")
        types = tuple(str(t).lower() for t in required(node, "types", "gguf") or ())
        allowed = (*QUANT_TYPES, TARGET_RECIPE)
        bad = [t for t in types if t not in allowed]
        if enabled and (bad or not types):
            raise ConfigError(
                f"gguf.types={list(types)!r}: "
                + (f"{bad} unknown" if bad else "empty")
                + f"; choose from {list(allowed)}"
            )
        target = required(node, "target", "gguf")
        if enabled and target and not Path(str(target)).expanduser().is_file():
            raise ConfigError(
                f"gguf.target={target!r} does not exist: point it at the target's .gguf"
            )
        return cls(enabled, tuple(dict.fromkeys(types)), str(target) if target else None)


def check_gguf_export(settings: GGUFSettings, vocab: str, drafter_config: dict) -> None:
    """Before any weights load: llama.cpp pairs models of one vocabulary only, and the writer
    writes the Llama architecture (data/models/gguf_writer.py)."""
    if not settings.enabled:
        return
    if vocab == "mapped":
        raise ConfigError(
            "gguf.enabled=true with a drafter of its own tokenizer: llama.cpp has no vocabulary "
            "mapping (its drafter must share the target's tokens), so no GGUF drafter can serve "
            "this pair; set gguf.enabled=false"
        )
    kind = drafter_config.get("model_type")  # None: a hub id, checked once its weights load
    if kind is not None:
        from specdistill.data.models.gguf_writer import check_architecture

        check_architecture(kind)


def drafter_file(kind: str) -> str:
    return f"drafter-{kind}.gguf"


def write_ggufs(model, folder: Path, settings: GGUFSettings, target: str, k: int) -> dict[str, Any]:
    """Write drafter-<type>.gguf for each type into `folder`, each checked against the target's
    GGUF vocabulary; returns export.json's `gguf` record."""
    from specdistill.data.models.gguf_vocab import compatibility_problems, read_gguf_vocab
    from specdistill.data.models.gguf_writer import types_for, write_llama_gguf
    from specdistill.data.models.target_gguf import target_gguf

    target_file = Path(settings.target).expanduser() if settings.target else target_gguf(target)
    target_vocab = read_gguf_vocab(target_file)
    files: dict[str, Any] = {}
    for kind in settings.types:
        out = folder / drafter_file(kind)
        written = write_llama_gguf(
            model,
            out,
            types=types_for(kind, target_file),
            tokenizer_gguf=target_file,
            name=f"{folder.name}-{kind}",
        )
        problems = compatibility_problems(target_vocab, read_gguf_vocab(out))
        if problems:
            raise ConfigError(
                f"gguf: {out.name} would be refused by llama.cpp as a drafter of "
                f"{target_file}: {problems[0]}"
            )
        files[kind] = {
            "file": out.name,
            "bytes": written.bytes,
            "file_type": written.file_type,
            "tensor_types": written.tensor_types,
        }
    return {"target": str(target_file), "files": files, "compatible": True, "k": k}


def served_file(record: dict[str, Any]) -> str:
    """The GGUF file the card's llama-server line serves: the first type requested."""
    return next(iter(record["files"].values()))["file"]


def gguf_section(
    record: dict[str, Any] | None, measured: dict[str, Any] | None = None
) -> list[str]:
    """The card's llama.cpp section: the files, the compatibility check, and (`measured`: the
    validate report's `llamacpp` section) how llama.cpp served this drafter; the command to
    serve it is the Use section's (export/deploy.py)."""
    if not record:
        return []
    from specdistill.decode.validate.engines import ENGINES

    served = ENGINES["llamacpp"].summary_lines([("this drafter", measured)] if measured else [])
    rows = [
        f"| `{f['file']}` | {kind} | {f['file_type']} | {f['bytes'] / 1e6:.1f} MB |"
        for kind, f in record["files"].items()
    ]
    return [
        "## llama.cpp",
        "",
        "The drafter as GGUF, its vocabulary copied from the target's GGUF file and checked "
        "against llama.cpp's drafter rule (vocabulary type, BOS/EOS flags and ids, size, every "
        f"token's text) before export: compatible with `{record['target']}`.",
        "",
        "| file | requested | GGUF file type | size |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        "Serve it with the llama-server line under Use. Where the server's threads take every core, add `--poll 0`: llama.cpp's worker threads "
        "otherwise spin between graph runs and the draft and target contexts starve each other "
        "(speculative decoding then slows down many times; specdistill's measurements pass it).",
        *served,
        "",
    ]
