"""Checkpoint integrity, checked before any weights load: a broken file is named in one line.

Every safetensors file's header is parsed and its tensors' byte ranges are checked against the
header size and the file size (a truncated copy is caught here, not as a `SafetensorError`
after the other model loaded); a shard index's files must all exist and hold the tensors it
maps to them; torch `.bin`/`.pt` zip archives must have their central directory (their end).
Only headers are read. Local folders only: hub downloads are size-checked by `from_pretrained`.
Tokenizer identity is `specdistill.data.models.tokenizer_identity`.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from specdistill.data.runtime import ConfigError

# Bytes per element; sub-byte and exotic dtypes are not size-checked (the ranges still are).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_DTYPE_BYTES |= {"U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def local_folder(name: str | Path) -> Path | None:
    p = Path(name).expanduser()
    return p if p.is_dir() else None


def _size(n: int) -> str:
    return f"{n:,} bytes"


def safetensors_header(path: Path) -> dict[str, Any]:
    """The parsed header of one safetensors file, after checking it covers the file exactly.

    Raises ValueError saying what is wrong (the caller names the field).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated ({_size(size)}: not even a header length)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise ValueError(
                f"{path} is truncated ({_size(size)}; its header alone needs {_size(8 + n)})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path} has a damaged header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a damaged header (not a JSON object)")
    end = 0
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            shape, dtype = info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} has a damaged header entry for {name!r}") from e
        numel = 1
        for d in shape:
            numel *= int(d)
        if dtype in _DTYPE_BYTES and hi - lo != numel * _DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{path} has a damaged header: {name!r} ({dtype} {shape}) spans {hi - lo} bytes"
            )
        spans.append((lo, hi))
        end = max(end, hi)
    need = 8 + n + end
    if size < need:
        raise ValueError(
            f"{path} is truncated ({_size(size)}; its header describes {_size(need)}, "
            f"{_size(need - size)} missing)"
        )
    if size > need:
        raise ValueError(f"{path} is damaged ({_size(size)}; its header describes {_size(need)})")
    return header


def _check_zip(path: Path) -> None:
    """torch.save archives are zips: a truncated one has lost its central directory."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return  # the legacy (pre-1.6) pickle format: nothing cheap to check
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        size = _size(path.stat().st_size)
        raise ValueError(f"{path} is truncated or damaged ({size}: {e})") from e


def weight_problem(folder: Path) -> str | None:
    """What is wrong with the weight files of a local checkpoint folder, or None."""
    try:
        for index_name in _INDEXES:
            index = folder / index_name
            if not index.exists():
                continue
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files: dict[str, list[str]] = {}
                for tensor, file in weight_map.items():
                    files.setdefault(str(file), []).append(str(tensor))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                return f"{index} is damaged ({type(e).__name__}: {e})"
            missing = sorted(f for f in files if not (folder / f).is_file())
            if missing:
                return (
                    f"{index} maps tensors to {len(files)} files, {len(missing)} of them missing "
                    f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})"
                )
            for file, tensors in sorted(files.items()):
                if file.endswith(".safetensors"):
                    header = safetensors_header(folder / file)
                    absent = [t for t in tensors if t not in header]
                    if absent:
                        return f"{folder / file} lacks {len(absent)} tensors {index} maps to it, e.g. {absent[0]!r}"
        for f in sorted(folder.glob("*.safetensors")):
            safetensors_header(f)
        for f in sorted([*folder.glob("*.bin"), *folder.glob("*.pt")]):
            _check_zip(f)
    except ValueError as e:
        return str(e)
    return None


def check_checkpoint_files(
    field_name: str, name: str | Path, fix: str = "copy or save the checkpoint again"
) -> None:
    """Refuse a local checkpoint whose weight files are incomplete, naming the file at fault.

    Hub names are left to `from_pretrained` (downloads are size-checked there).
    """
    folder = local_folder(name)
    if folder is None:
        return
    problem = weight_problem(folder)
    if problem:
        raise ConfigError(
            f"{field_name}={str(name)!r} is incomplete: {problem}; {fix} (nothing was loaded)"
        )


def check_saved_file(what: str, path: Path, fix: str) -> None:
    """One saved file (safetensors or a torch.save zip) complete, else one line naming it."""
    try:
        if path.suffix == ".safetensors":
            safetensors_header(path)
        else:
            _check_zip(path)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}; {fix}") from e
