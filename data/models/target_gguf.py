"""The target as a GGUF file, for llama.cpp: the file it came from, or one written once.

llama.cpp serves a target and a drafter both as GGUF. A target that was a GGUF file (the
embedded SmolLM2 pair, any `.gguf` path) is served from that file, as users would serve it: its
converted checkpoint records the source (data/models/gguf.py). A `transformers` target of the
Llama architecture (the toy world's) is written once as f16 GGUF with `gguf_writer` and cached
under `$SPECDISTILL_HOME/gguf_written/`, keyed by its weights' hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specdistill.data.io import build_once
from specdistill.data.runtime import ConfigError, specdistill_home

WRITTEN_FILE = "model-f16.gguf"
MARKER = "written.json"


def gguf_source(target: str | Path) -> Path | None:
    """The GGUF file a converted checkpoint came from (None: not converted from GGUF)."""
    from specdistill.data.models.gguf import INFO_FILE, is_gguf

    if is_gguf(str(target)) and Path(target).is_file():
        return Path(target)
    info = Path(target) / INFO_FILE
    if not info.is_file():
        return None
    source = Path(json.loads(info.read_text())["source"])
    return source if source.is_file() else None


def _weights_key(folder: Path) -> str:
    from specdistill.data.models.gguf import file_digest

    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(file_digest(f).encode())
    return h.hexdigest()[:16]


def target_gguf(target: str | Path, field: str = "pair.target") -> Path:
    """The target's GGUF file: its source, or written once from the checkpoint folder."""
    source = gguf_source(target)
    if source is not None:
        return source
    folder = Path(target)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{field}={str(target)!r} is not a local checkpoint or GGUF file: llama.cpp needs the "
            "target as GGUF; convert it with llama.cpp's convert_hf_to_gguf.py and pass the file "
            "(export.gguf.target / llamacpp.target)"
        )
    root = specdistill_home() / "gguf_written" / f"{folder.name}-{_weights_key(folder)}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specdistill.data.models.gguf_writer import write_llama_gguf

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder)
        written = write_llama_gguf(
            model, tmp / WRITTEN_FILE, types="f16", tokenizer=tok, name=folder.name
        )
        (tmp / MARKER).write_text(json.dumps({"source": str(folder), "bytes": written.bytes}))

    return build_once(root, MARKER, build) / WRITTEN_FILE
