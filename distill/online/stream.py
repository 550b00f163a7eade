"""The request stream of online adaptation: segments of prompt sources, planned up front.

`stream: [{dataset: SOURCE, requests: N}, ...]` where SOURCE is a named source (`toy-train`,
`toy-test`: the toy world's prompt sets; `stdlib-mail`, `stdlib-numeric`, ...: stdlib files
outside the toy world, see `specdistill.data.toy.stream`) or a `dataset` mapping (any prompt set
`load_prompts` reads: hub, jsonl, parquet). `stream_blend: B` mixes the next segment into the
last B requests of each segment with a linearly rising share (0: sharp boundaries).

The whole plan (which prompt each request gets) is a pure function of the config and the seed,
so a resumed run serves exactly the requests an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.prompts import Prompt, load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.data.toy.stream import SOURCE_GROUPS, group_prompts

TOY_SOURCES = {"toy-train": "train", "toy-test": "test"}
NAMED_SOURCES = (*TOY_SOURCES, *SOURCE_GROUPS)


@dataclass(frozen=True)
class Segment:
    label: str  # the source's name, or a short description of a dataset mapping
    dataset: Any  # str (named source) or dict (a `dataset` config node)
    requests: int


@dataclass(frozen=True)
class Request:
    id: int
    segment: int
    source: str
    prompt: int  # index into the source's prompt list


# `load_prompts` sources a stream segment may name (self: queries sampled from the target)
DATASET_SOURCES = ("toy", "hub", "jsonl", "json", "parquet", "csv", "self")


def parse_stream(stream: Any) -> list[Segment]:
    """Check the `stream` list (names, counts) without reading any prompts."""
    if isinstance(stream, DictConfig) or hasattr(stream, "_content"):
        stream = OmegaConf.to_container(stream, resolve=True)
    if not isinstance(stream, list) or not stream:
        raise ConfigError("stream must be a non-empty list of {dataset: SOURCE, requests: N}")
    segments = []
    for i, item in enumerate(stream):
        if not isinstance(item, dict) or "dataset" not in item:
            raise ConfigError(f"stream[{i}] must be a mapping with `dataset` and `requests`")
        n = item.get("requests")
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(f"stream[{i}].requests={n!r} must be a positive integer")
        ds = item["dataset"]
        if isinstance(ds, str):
            if ds not in NAMED_SOURCES:
                raise ConfigError(
                    f"stream[{i}].dataset={ds!r} is not a known prompt source; use one of "
                    f"{', '.join(NAMED_SOURCES)} or a dataset mapping ({{source: jsonl, path: ...}})"
                )
            label = ds
        elif isinstance(ds, dict):
            if ds.get("source", "toy") not in DATASET_SOURCES:
                raise ConfigError(
                    f"stream[{i}].dataset.source={ds.get('source')!r} is not known; use toy, hub, "
                    "jsonl, parquet or self"
                )
            label = str(ds.get("name") or ds.get("path") or ds.get("source", "toy"))
            label = f"{label}:{ds.get('split') or 'train'}"
        else:
            raise ConfigError(f"stream[{i}].dataset must be a source name or a dataset mapping")
        segments.append(Segment(label=label, dataset=ds, requests=n))
    return segments


def load_sources(
    segments: list[Segment], toy: str | None, tokenizer, *, target: str | None = None
) -> dict[str, list[Prompt]]:
    """Each distinct source's prompts (no model involved, except `source: self`, which samples
    its queries from `target`, the resolved target path, once and caches them); an empty
    source is an error."""
    out: dict[str, list[Prompt]] = {}
    for i, seg in enumerate(segments):
        if seg.label in out:
            continue
        ds = seg.dataset
        if isinstance(ds, str) and ds in TOY_SOURCES:
            if not toy:
                raise ConfigError(
                    f"stream[{i}].dataset={ds!r} needs a toy pair (pair.toy); use a stdlib-* "
                    "source or a dataset mapping for other pairs"
                )
            prompts = load_prompts({"source": "toy", "toy": toy, "split": TOY_SOURCES[ds]})
        elif isinstance(ds, str):
            rows = group_prompts(ds)
            prompts = [Prompt(j, r["prompt"], r["completion"]) for j, r in enumerate(rows)]
        else:
            prompts = load_prompts(ds, tokenizer, default_split="train", target=target)
        if not prompts:
            hint = ""
            if isinstance(ds, str) and ds.startswith("stdlib-"):
                hint = (
                    f": this Python's standard library ({sysconfig.get_paths()['stdlib']}) lacks the files it "
                    "reads (Debian/Ubuntu split test/, idlelib/ and turtledemo/ into packages: "
                    "install idle-python3.X and libpython3.X-testsuite, or use a python.org / "
                    "pyenv build)"
                )
            raise ConfigError(f"stream[{i}].dataset={seg.label!r} yields no prompts{hint}")
        out[seg.label] = prompts
    return out


def plan_requests(
    segments: list[Segment], sizes: dict[str, int], blend: int, seed: int
) -> list[Request]:
    """Every request of the stream: its segment, source and prompt (deterministic in `seed`).

    Each source's prompts are served in a seeded shuffled order, cycling only if a stream asks
    for more requests than the source has; sources shared by segments share that order.
    """
    rng = random.Random(seed)
    orders = {}
    for label in sorted(sizes):
        order = list(range(sizes[label]))
        random.Random(f"{seed}:{label}").shuffle(order)
        orders[label] = order
    cursor = dict.fromkeys(sizes, 0)
    plan: list[Request] = []
    for s, seg in enumerate(segments):
        nxt = segments[s + 1] if s + 1 < len(segments) else None
        for o in range(seg.requests):
            source = seg.label
            ramp = o - (seg.requests - blend) + 1  # 1..blend inside the ramp, <= 0 before it
            u = rng.random()
            if nxt is not None and blend > 0 and ramp > 0 and u < ramp / (blend + 1):
                source = nxt.label
            k = cursor[source]
            cursor[source] += 1
            order = orders[source]
            plan.append(Request(len(plan), s, source, order[k % len(order)]))
    return plan


def boundaries(segments: list[Segment]) -> list[int]:
    """Request counts at which a new segment starts (for plots and per-segment figures)."""
    out, total = [], 0
    for seg in segments[:-1]:
        total += seg.requests
        out.append(total)
    return out


def plan_fingerprint(plan: list[Request]) -> str:
    text = json.dumps([(r.segment, r.source, r.prompt) for r in plan])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
