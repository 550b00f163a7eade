"""The pair's GGUF files as validate's llama.cpp engine serves them
(decode/validate/engines/llamacpp.py): what can be checked of them before weights load, and the
drafter's file: the given one, or the loaded drafter written with the target file's recipe,
checked against the target's GGUF by llama.cpp's own drafter rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdistill.data.runtime import ConfigError

ASKED_BY = "engines=[ours,llamacpp]"  # the setting that asks for llama.cpp, named in its refusals


def check_files(
    target: str | None, drafter: str | None, spec: Any, asked_by: str = ASKED_BY
) -> None:
    """The pair's files before weights load: a target llama.cpp can be given (its GGUF file, or
    a Llama checkpoint specdistill writes as GGUF), a drafter specdistill can write, and two
    given files llama.cpp would pair (`target`, `drafter`: `llamacpp.target`, `.drafter`);
    `asked_by`: the setting that asked for llama.cpp, named in each refusal."""
    from specdistill.data.models.gguf_writer import check_architecture
    from specdistill.data.models.target_gguf import gguf_source

    if target is None and gguf_source(spec.target) is None:
        config = Path(str(spec.target)) / "config.json"
        if not config.is_file():
            raise ConfigError(
                f"{asked_by}: pair.target={spec.target!r} is neither a GGUF file nor a local "
                "checkpoint; give its GGUF file as llamacpp.target"
            )
        kind = json.loads(config.read_text()).get("model_type")
        if kind != "llama":
            raise ConfigError(
                f"{asked_by}: pair.target is {kind!r} and specdistill writes Llama GGUF files "
                "only; convert the target with llama.cpp's convert_hf_to_gguf.py and give the "
                "file as llamacpp.target"
            )
    if drafter is None:
        config = Path(str(spec.drafter)) / "config.json"
        if config.is_file():  # a hub id is checked once its weights load
            kind = json.loads(config.read_text()).get("model_type")
            check_architecture(kind, asked_by, "llamacpp.drafter to a .gguf file")
    target = target or gguf_source(spec.target)
    if drafter is not None and target is not None:  # both files exist: pair them now
        check_pairing(Path(target), Path(drafter), asked_by)


def check_pairing(target: Path, drafter: Path, asked_by: str = ASKED_BY) -> None:
    """llama.cpp's drafter rule on the two files (data/models/gguf_vocab.py), one line."""
    from specdistill.data.models.gguf_vocab import compatibility_problems, read_gguf_vocab

    problems = compatibility_problems(read_gguf_vocab(target), read_gguf_vocab(drafter))
    if problems:
        raise ConfigError(
            f"{asked_by}: llama.cpp would refuse {drafter.name} as a drafter of {target.name}: "
            f"{problems[0]}"
        )


def drafter_gguf(given: str | None, kind: str, drafter: Any, target_file: Path, folder: Path):
    """(the drafter's GGUF path, its record): the `given` file, or `drafter` written as `kind`
    (`llamacpp.drafter_type`); checked against the target's GGUF by llama.cpp's drafter rule."""
    from specdistill.data.models.gguf_writer import types_for, write_llama_gguf

    record: dict[str, Any]
    if given is not None:
        path = Path(given)
        record = {"file": str(path), "written": False, "bytes": path.stat().st_size}
    else:
        check_rows(drafter)
        path = folder / f"drafter-{kind}.gguf"
        written = write_llama_gguf(drafter, path, types=types_for(kind, target_file),
                                   tokenizer_gguf=target_file,
                                   name=f"drafter-{kind}")  # fmt: skip
        record = {"file": str(path), "written": True, "type": kind, "bytes": written.bytes,
                  "file_type": written.file_type}  # fmt: skip
    check_pairing(target_file, path)
    return path, record


def check_rows(drafter: Any) -> None:
    """A head of other rows than the embedding (a draft-vocabulary checkpoint) is not servable:
    llama.cpp scores every token of the shared vocabulary."""
    head = drafter.get_output_embeddings()
    emb = drafter.get_input_embeddings()
    if head is not None and head.weight.shape[0] != emb.weight.shape[0]:
        raise ConfigError(
            f"{ASKED_BY}: the drafter's head has {head.weight.shape[0]} rows and its embedding "
            f"{emb.weight.shape[0]} (a draft-vocabulary checkpoint); export it (the export "
            "restores the full head) and validate the exported folder"
        )
