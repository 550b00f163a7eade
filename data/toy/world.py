"""The embedded toy world: real code data and real checkpoints, built offline from the stdlib.

No hub is reachable in CI and a first run should not need one, so the toy world trains its own
byte-level BPE tokenizer, a small Llama target and a much smaller base drafter on the Python
standard library's source, and extracts HumanEval-like prompts (signature + docstring) from
held-out modules. Everything is an ordinary `transformers` checkpoint, loaded downstream with
`from_pretrained` exactly like a hub model. Builds are deterministic, cached under
`$SPECDISTILL_HOME` (default `~/.cache/specdistill`), locked against concurrent builders and
published atomically (temp dir + rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdistill.data.io import build_once
from specdistill.data.runtime import specdistill_home
from specdistill.data.toy.code_prompts import extract_prompts, prompt_set, read_jsonl, write_jsonl
from specdistill.data.toy.corpus import corpus_files, is_held_out, read_texts
from specdistill.data.toy.specs import SPECS, ToySpec
from specdistill.data.toy.tokenizer import token_stream, train_tokenizer
from specdistill.data.toy.training import heldout_loss, make_llama, train_lm

# What other modules and tests import from here: the world's own names, and the pieces of its
# build that live beside it (corpus, tokenizer, models' training, prompt sets).
__all__ = [
    "SPECS",
    "TOY_VERSION",
    "ToyWorld",
    "corpus_files",
    "ensure_toy_world",
    "extract_prompts",
    "is_held_out",
    "main",
    "read_jsonl",
    "spec_files",
    "toy_prompts",
    "toy_tokenizer_dir",
    "train_tokenizer",
]

log = logging.getLogger(__name__)

# Bump when anything changes what a build produces (here or in specs.py, corpus.py,
# tokenizer.py, training.py, code_prompts.py), so stale caches are not reused.
TOY_VERSION = 2


@dataclass(frozen=True)
class ToyWorld:
    """Paths of one built toy world."""

    name: str
    root: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def drafter_dir(self) -> Path:
        return self.root / "drafter"

    @property
    def train_prompts(self) -> Path:
        return self.root / "prompts" / "train.jsonl"

    @property
    def test_prompts(self) -> Path:
        return self.root / "prompts" / "test.jsonl"

    @property
    def build_info(self) -> dict:
        return json.loads((self.root / "build.json").read_text())


def _cache_dir(name: str) -> Path:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return specdistill_home() / "toy" / f"{name}-v{TOY_VERSION}-{py}"


def ensure_toy_world(name: str = "toy-tiny") -> ToyWorld:
    """Return the toy world `name`, building it first if it is not cached."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"pair.toy={name!r} is not a toy world; choose one of {sorted(SPECS)}")
    root = build_once(
        _cache_dir(name), "build.json", lambda tmp: _build(SPECS[name], ToyWorld(name, tmp))
    )
    return ToyWorld(name=name, root=root)


def toy_prompts(name: str, split: str) -> list[dict]:
    """The toy world `name`'s prompt set without building its models: read from the built world
    when there is one, else extracted from the stdlib exactly as its build would (same modules,
    same cap, same order) and cached beside it. A real pair reads toy prompts this way: the full
    world's 2000 training prompts cost seconds, not its minutes of model training."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"dataset.toy={name!r} is not a toy world; choose one of {sorted(SPECS)}")
    world = ToyWorld(name=name, root=_cache_dir(name))
    path = world.train_prompts if split == "train" else world.test_prompts
    if (world.root / "build.json").exists():
        return read_jsonl(path)
    cached = _cache_dir(name).with_name(_cache_dir(name).name + "-prompts") / f"{split}.jsonl"
    if not cached.exists():
        spec = SPECS[name]
        train_paths, held_paths = spec_files(spec)
        paths, cap = (
            (train_paths, spec.max_train_prompts)
            if split == "train"
            else (held_paths, spec.max_test_prompts)
        )
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        write_jsonl(tmp, prompt_set(paths, cap))
        os.replace(tmp, cached)
    return read_jsonl(cached)


def toy_tokenizer_dir(name: str) -> Path:
    """The toy world `name`'s tokenizer folder without building its models: the built world's,
    else trained alone exactly as its build would (same texts, same settings; cheap: no model is trained)
    and cached beside it. The vocabulary mapping of the toy drafter against another target needs
    only this."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"toy world {name!r} does not exist; choose one of {sorted(SPECS)}")
    world = ToyWorld(name=name, root=_cache_dir(name))
    if (world.root / "build.json").exists():
        return world.tokenizer_dir
    spec = SPECS[name]

    def build(tmp: Path) -> None:
        tokenizer = train_tokenizer(read_texts(spec_files(spec)[0]), spec.vocab_size)
        tokenizer.model_max_length = spec.max_positions
        tokenizer.save_pretrained(tmp)
        (tmp / "done").write_text("1")

    return build_once(
        _cache_dir(name).with_name(_cache_dir(name).name + "-tokenizer"), "done", build
    )


def spec_files(spec: ToySpec) -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib files of a spec: tiny worlds take a deterministic spread of
    training files, not the alphabetically first ones."""
    train_paths, held_paths = corpus_files()
    if spec.train_files is not None:
        train_paths = sorted(train_paths, key=lambda p: hashlib.md5(p.name.encode()).hexdigest())
        train_paths = sorted(train_paths[: spec.train_files])
    return train_paths, held_paths


def save_servable(model, tokenizer, out: Path) -> None:
    """Save a toy model as engines load it: a generation config that pads and stops with the
    tokenizer's pad and EOS (vLLM and `generate` read them from there), the tokenizer beside it."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _build(spec: ToySpec, world: ToyWorld) -> None:
    t_start = time.perf_counter()
    torch_threads = torch.get_num_threads()
    log.info("building toy world %r under %s (one-off; cached afterwards)", spec.name, world.root)
    world.root.mkdir(parents=True)
    train_paths, held_paths = spec_files(spec)
    train_texts, held_texts = read_texts(train_paths), read_texts(held_paths)

    t = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, spec.vocab_size)
    tokenizer.model_max_length = spec.max_positions
    tokenizer.save_pretrained(world.tokenizer_dir)
    t_tok = time.perf_counter() - t

    train_stream = token_stream(tokenizer, train_texts)
    held_stream = token_stream(tokenizer, held_texts[:40])
    vocab = len(tokenizer)

    info: dict = {"spec": asdict(spec), "torch_threads": torch_threads, "version": TOY_VERSION}
    info["corpus"] = {
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "train_tokens": len(train_stream),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "tokenizer_seconds": round(t_tok, 2),
    }
    for role, shape, steps, seed, out in (
        ("target", spec.target, spec.target_steps, 1, world.target_dir),
        ("drafter", spec.drafter, spec.drafter_steps, 2, world.drafter_dir),
    ):
        model = make_llama(shape, vocab, spec.max_positions, tokenizer, seed)
        t = time.perf_counter()
        tps = train_lm(model, train_stream, spec, steps, seed, desc=f"toy {role}")
        info[role] = {
            "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.perf_counter() - t, 1),
            "train_tokens_per_s": round(tps),
            "heldout_loss": round(heldout_loss(model, held_stream, spec.seq_len), 4),
        }
        save_servable(model, tokenizer, out)
        log.info("toy %s: %s", role, info[role])

    write_jsonl(world.train_prompts, prompt_set(train_paths, spec.max_train_prompts))
    write_jsonl(world.test_prompts, prompt_set(held_paths, spec.max_test_prompts))
    info["prompts"] = {
        "train": sum(1 for _ in world.train_prompts.open()),
        "test": sum(1 for _ in world.test_prompts.open()),
    }
    info["build_seconds"] = round(time.perf_counter() - t_start, 1)
    (world.root / "build.json").write_text(json.dumps(info, indent=2))


def main() -> None:
    """`python -m specdistill.data.toy.world [toy|toy-tiny]`: build (or find) a toy world."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name = sys.argv[1] if len(sys.argv) > 1 else "toy"
    world = ensure_toy_world(name)
    print(json.dumps({"root": str(world.root), **world.build_info}, indent=2))


if __name__ == "__main__":
    main()
