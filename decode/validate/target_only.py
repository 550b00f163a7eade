"""The target-only side of validate, decoded once and shared by the validate steps of one run.

A pipeline validates several drafters of one target on the same prompts (validate_base, the
distilled drafter, `compare_drafters`), and each step would decode the same target-only passes
again: the target's answers to earlier turns of a multi-turn question, and the timed target-only
decodes of both serving modes that `lossless` and the speedup compare against. None of that
depends on the drafter. With `target_only_cache: DIR` (the pipeline sets `<run_dir>/target_only`)
the first step writes them there and the others read them: the same tokens (greedy figures stay
token-identical checks against the target), and the same timing, measured in this run on this
machine (the key holds the machine's name and threads), so a later step's speedup divides by a
baseline it did not time itself. The report says so in a note.

The key is everything that decides a pass: the target's files (`target_key`), device, dtype,
machine, the exact prompt batches, the sampling spec, seed, `max_new_tokens`, EOS ids and the
decoder's step settings (cache, compiled steps, host syncs). Files are written atomically, so
steps running at once (Slurm) at worst both decode and one file wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdistill.data.io import atomic_write_json
from specdistill.data.models.drafter_from_target import target_key
from specdistill.data.runtime import ConfigError
from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.validate.turns import Answer

log = logging.getLogger(__name__)

VERSION = 1  # bump when what a pass records changes


class BaselinePass(NamedTuple):
    """One timed target-only repeat, batch by batch: wall seconds and output per batch."""

    seconds: list[float]
    outs: list[DecodeOutput]


def output_record(out: DecodeOutput) -> dict[str, Any]:
    """A target-only output as JSON: its tokens and counters (it has no rounds to keep)."""
    if out.rounds:
        raise ValueError("a target-only output has no rounds: this is a speculative decode's")
    record = dataclasses.asdict(dataclasses.replace(out, by_row=[], rounds=[]))
    record["by_row"] = [output_record(r) for r in out.by_row]
    return record


def output_from_record(record: dict[str, Any]) -> DecodeOutput:
    """The inverse of `output_record`."""
    fields = dict(record)
    fields["by_row"] = [output_from_record(r) for r in fields.get("by_row", [])]
    fields["rounds"] = []
    return DecodeOutput(**fields)


def batches_digest(batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The exact prompt batches (ids and masks, in order): another split of the same prompts
    into batches pads and times differently, so it is another key."""
    h = hashlib.sha256()
    for ids, mask in batches:
        for t in (ids, mask):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class TargetOnlyCache:
    """A folder of target-only passes and answers, each file named by its key's digest.

    `base`: the key's parts that every entry shares (the target, device, dtype, machine)."""

    folder: Path
    base: dict[str, Any]

    @classmethod
    def create(
        cls, folder: str | Path, target: str, revision: str | None, device: torch.device,
        dtype: torch.dtype, machine: str,
    ) -> TargetOnlyCache:  # fmt: skip
        folder = Path(folder).expanduser().absolute()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"target_only_cache={str(folder)!r}: the folder cannot be created ({e.strerror}); "
                "point it at a writable folder, or null"
            ) from e
        base = {
            "version": VERSION,
            "target": target_key(target, revision),
            "device": str(device),
            "dtype": str(dtype),
            "machine": machine,  # the CPU or GPU, cores and torch threads
        }
        return cls(folder, base)

    def _path(self, kind: str, key: dict[str, Any]) -> Path:
        blob = json.dumps(self.base | key, sort_keys=True, default=str).encode()
        return self.folder / f"{kind}-{hashlib.sha256(blob).hexdigest()[:24]}.json"

    def _read(self, path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))["value"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as e:  # a torn or foreign file: decode again
            log.warning("target-only cache %s unreadable (%s): decoding again", path, e)
            return None

    def load_answers(self, key: dict[str, Any]) -> list[str] | None:
        """The target's greedy answers to the prompts `key` names, if a step wrote them."""
        return self._read(self._path("answers", key))

    def save_answers(self, key: dict[str, Any], answers: list[str]) -> None:
        atomic_write_json(self._path("answers", key), {"key": key, "value": answers})

    def load_passes(self, key: dict[str, Any], repeats: int) -> list[BaselinePass] | None:
        """The first `repeats` timed target-only passes `key` names, if a step timed as many."""
        value = self._read(self._path("passes", key))
        if value is None or len(value) < repeats:
            return None
        return [
            BaselinePass(list(p["seconds"]), [output_from_record(o) for o in p["outs"]])
            for p in value[:repeats]
        ]

    def save_passes(self, key: dict[str, Any], passes: Sequence[BaselinePass]) -> None:
        value = [
            {"seconds": list(p.seconds), "outs": [output_record(o) for o in p.outs]} for p in passes
        ]
        atomic_write_json(self._path("passes", key), {"key": key, "value": value})


def shared_answers(cache: TargetOnlyCache | None, answer: Answer, settings: dict) -> Answer:
    """`answer` (the target's greedy replies to earlier turns), read from the cache where a step
    already answered the same prompt rows under the same `settings`, else run and written."""
    if cache is None:
        return answer

    def cached(rows: list[list[int]]) -> list[str]:
        key = settings | {"rows": hashlib.sha256(json.dumps(rows).encode()).hexdigest()}
        got = cache.load_answers(key)
        if got is None or len(got) != len(rows):
            got = answer(rows)
            cache.save_answers(key, got)
        return got

    return cached


def passes_key(dec: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], seed: int) -> dict:
    """What decides a decoder's target-only passes over `batches` (its drafter does not)."""
    cfg, s = dec.cfg, dec.cfg.sampling
    return {
        "batches": batches_digest(batches),
        "sampling": [s.temperature, s.top_k, s.top_p],
        "seed": seed,
        "max_new_tokens": cfg.max_new_tokens,
        "eos": sorted(cfg.eos_token_id),
        "steps": {"static": dec.static, "compiled": dec.compile, "sync_every": dec.sync_every},
    }


@dataclass
class SharedBaseline:
    """One decoder's view of the cache for `timed_repeats`: the passes to reuse (None: time
    them here), and, after a pass timed here, where to write them."""

    cache: TargetOnlyCache
    key: dict[str, Any]
    reused: list[BaselinePass] | None

    @classmethod
    def open(cls, cache: TargetOnlyCache | None, dec: Any, batches, seed: int, repeats: int):
        """None without a cache, else the key's passes when a step already timed them."""
        if cache is None:
            return None
        key = passes_key(dec, batches, seed)
        return cls(cache, key, cache.load_passes(key, repeats))

    def save(self, passes: Sequence[BaselinePass]) -> None:
        if self.reused is None:
            self.cache.save_passes(self.key, passes)
