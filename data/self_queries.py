"""`dataset.source: self`: user queries sampled from the target p itself (Magpie, Xu et al. 2024).

Given only its template's header up to the user turn (system prompt, then e.g.
"<|im_start|>user\n"), an aligned chat model writes a plausible user query: open-ended chat
traffic (writing, advice, roleplay) in the target's own distribution, which the offline sets
here (T0 prompts, GSM8K, code) lack. A sample counts only if it ends with the template's
end-of-turn token (or EOS) within `max_query_tokens` (a small model's query can run
past it without ending), is not empty and is no exact duplicate. Rows are `{"id": "self-<i>",
"messages": [system?, user]}`, read like a `format: messages` set, so `holdout`, `limit` and
mixtures treat them as any source. Sampling costs minutes on a CPU and every stage and shard
must read the same set: cached under `$SPECDISTILL_HOME/self_queries/<key>.jsonl`, the key a
hash of all that decides the queries; one process samples, the others wait on its lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdistill.data.conversations import template_kwargs
from specdistill.data.io import atomic_write_text
from specdistill.data.models.drafter_from_target import target_key
from specdistill.data.models.pairs import load_model
from specdistill.data.query_stream import sampling_draw, stream_samples, supported
from specdistill.data.runtime import ConfigError, node_get, resolve_device, specdistill_home
from specdistill.data.sampling import KEYS, Sampling

log = logging.getLogger(__name__)

VERSION = 2  # bump when sampling or filtering changes, so older caches are not reused
SPLIT = "\x00SPLIT\x00"  # a user message no template rewrites: the header is the text before it
Sampler = Callable[[int], list[list[int]]]  # batch index -> sampled token rows


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# How queries are drawn unless the node's `sampling` says otherwise: the target's own distribution
SAMPLING = Sampling(temperature=1.0)


@dataclass(frozen=True)
class SelfSettings:
    """A `source: self` node's settings, checked before any weights load (errors name the field).
    `sampling` is the one sampling spec (`data/sampling.py`), at temperature > 0."""

    count: int
    seed: int = 0
    system: str | None = None
    max_query_tokens: int = 48
    sampling: Sampling = SAMPLING
    batch_size: int = 64
    model: str | None = None

    @classmethod
    def from_node(cls, node: Any, field: str = "dataset") -> SelfSettings:
        v = {k: node_get(node, k, getattr(cls, k, None)) for k in cls.__dataclass_fields__}
        v["seed"] = v["seed"] or 0  # seed: null
        for key, least in (("count", 1), ("max_query_tokens", 1), ("batch_size", 1), ("seed", 0)):
            if not _is_int(v[key]) or (key != "seed" and v[key] < least):
                need = "an integer" if key == "seed" else f"an integer >= {least}"
                raise ConfigError(f"{field}.{key}={v[key]!r} must be {need} (source self)")
        # the per-key spelling beside `sampling` is refused by name, as on every stage
        parent = {
            k: node_get(node, k) for k in (*KEYS, "do_sample") if node_get(node, k) is not None
        }
        parent["sampling"] = node_get(node, "sampling") or SAMPLING.as_dict()
        v["sampling"] = Sampling.from_parent(parent, f"{field}.sampling")
        if v["sampling"].greedy:
            raise ConfigError(
                f"{field}.sampling.temperature=0 is greedy: queries are sampled (> 0, e.g. 1.0)"
            )
        for key in ("system", "model"):
            if v[key] is not None and (not isinstance(v[key], str) or not v[key].strip()):
                raise ConfigError(f"{field}.{key}={v[key]!r} must be a non-empty string or null")
        return cls(**v)


def keep_queries(
    rows: Sequence[Sequence[int]],
    stops: Collection[int],
    decode: Callable[[list[int]], str],
    seen: set[str],
    special: Collection[int] = (),
) -> tuple[list[str], Counter[str]]:
    """The queries worth keeping from sampled token rows, in order, and a tally of why the rest
    were dropped: `runaway` (no stop token: cut mid-query, it never said it was done),
    `special` (a special token inside: template debris, not a question), `empty`, `duplicate`
    (exact, after strip; `seen` is updated with what is kept)."""
    kept: list[str] = []
    tally: Counter[str] = Counter()
    for row in rows:
        end = next((k for k, t in enumerate(row) if t in stops), None)
        if end is None:
            tally["runaway"] += 1
            continue
        ids = list(row[:end])
        text = decode(ids).strip()
        why = "special" if any(t in special for t in ids) else "empty" if not text else None
        why = why or ("duplicate" if text in seen else None)
        if why:
            tally[why] += 1
            continue
        seen.add(text)
        kept.append(text)
        tally["kept"] += 1
    return kept, tally


def collect_queries(
    sample: Sampler,
    decode: Callable[[list[int]], str],
    stops: Collection[int],
    s: SelfSettings,
    *,
    special: Collection[int] = (),
    field: str = "dataset",
) -> list[str]:
    """`s.count` queries from batches `sample(0), sample(1), ...`, at most ceil(4 count /
    batch_size) of them (a target that rarely ends its query is a setting to fix, not a loop
    to wait on): one ConfigError line with the tally when too few are kept."""
    from tqdm.auto import tqdm

    batches = math.ceil(4 * s.count / s.batch_size)
    seen: set[str] = set()
    out: list[str] = []
    tally: Counter[str] = Counter()
    with tqdm(total=s.count, desc="self queries", unit="query") as bar:
        for b in range(batches):
            new, t = keep_queries(sample(b), stops, decode, seen, special)
            bar.update(min(len(new), s.count - len(out)))
            out += new
            tally += t
            if len(out) >= s.count:
                log.info("self queries: %s in %d batches of %d", dict(tally), b + 1, s.batch_size)
                return out[: s.count]
    raise ConfigError(
        f"{field}.count={s.count}: only {len(out)} queries kept from {batches} batches of "
        f"{s.batch_size} samples ({tally['runaway']} ran past {field}.max_query_tokens="
        f"{s.max_query_tokens} without the end-of-turn token, {tally['duplicate']} duplicates, "
        f"{tally['empty'] + tally['special']} empty or with special tokens): raise "
        f"{field}.max_query_tokens or lower {field}.count (is the model a chat model?)"
    )


def template_header(tokenizer: Any, system: str | None, kwargs: dict[str, Any]) -> tuple[str, int]:
    """(the text before the user's words, the end-of-turn id): a one-message conversation is
    rendered around a sentinel user message; the header is what precedes it, the end of turn the
    first special token the template puts after it (else its first token, else EOS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "dataset source 'self' samples queries after the chat template's user header: the "
            "tokenizer has no chat_template (use a chat model as the target, or dataset.model)"
        )
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": SPLIT})
    text = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=False, **kwargs
    )
    if text.count(SPLIT) != 1 or not text.split(SPLIT)[0]:
        raise ConfigError(
            "dataset source 'self': the chat template does not render a header before the user "
            "message (or rewrites the message): no query can be sampled after it"
        )
    header, tail = text.split(SPLIT)
    tail_ids = tokenizer(tail, add_special_tokens=False).input_ids
    special = _special_ids(tokenizer)
    eot = next((t for t in tail_ids if t in special), tail_ids[0] if tail_ids else None)
    eot = tokenizer.eos_token_id if eot is None else eot
    if eot is None:
        raise ConfigError(
            "dataset source 'self': the chat template puts nothing after a user message and the "
            "tokenizer has no EOS token: no sampled query can be seen to end"
        )
    return header, int(eot)


def _special_ids(tokenizer: Any) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def batch_seed(seed: int, batch: int) -> int:
    """Batch `batch`'s sampling seed: batches draw the same whatever ran before them."""
    return int.from_bytes(hashlib.sha256(f"self/{seed}/{batch}".encode()).digest()[:8], "big")


def model_sampler(
    model: Any, header_ids: list[int], s: SelfSettings, stops: Collection[int], pad_id: int
) -> Sampler:
    """`sample(0), sample(1), ...` (called in that order): the next `batch_size` samples of a
    batch of `batch_size` rows that restart as each sample ends (`data/query_stream.py`), drawn
    from one generator seeded by `seed` (the caller's random state is left as it was); a model
    whose cache cannot be rewritten row by row samples fixed batches (`fixed_batch_sampler`)."""
    if not supported(model):
        return fixed_batch_sampler(model, header_ids, s, stops, pad_id)
    generator = torch.Generator(device=model.device).manual_seed(batch_seed(s.seed, 0))
    stream = stream_samples(
        model, header_ids, s.max_query_tokens, stops, s.batch_size,
        sampling_draw(s.sampling, generator),
    )  # fmt: skip

    def sample(batch: int) -> list[list[int]]:
        return [next(stream).ids for _ in range(s.batch_size)]

    return sample


def fixed_batch_sampler(
    model: Any, header_ids: list[int], s: SelfSettings, stops: Collection[int], pad_id: int
) -> Sampler:
    """Batches of `batch_size` identical headers (no padding) sampled by `generate`, each batch
    seeded by `batch_seed` inside `fork_rng` (the caller's random state is left as it was)."""
    from transformers import GenerationConfig

    config = GenerationConfig(  # every setting explicit: none comes from the checkpoint
        do_sample=True,
        temperature=s.sampling.temperature,
        top_p=s.sampling.top_p,
        top_k=s.sampling.top_k,
        max_new_tokens=s.max_query_tokens,
        eos_token_id=sorted(stops),
        pad_token_id=pad_id,
    )
    ids = torch.tensor([header_ids] * s.batch_size, device=model.device)
    cuda = [model.device.index or 0] if model.device.type == "cuda" else []

    def sample(batch: int) -> list[list[int]]:
        with torch.random.fork_rng(devices=cuda), torch.inference_mode():
            torch.manual_seed(batch_seed(s.seed, batch))
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
        return out[:, ids.shape[1] :].tolist()

    return sample


def self_query_rows(
    node: Any, target: str | None, tokenizer: Any, *, field: str = "dataset"
) -> list[dict[str, Any]]:
    """`count` rows `{"id": "self-<i>", "messages": [system?, user]}` of queries sampled from
    `node.model`, else `target` (the stage's resolved target path), after the template's user
    header; read from the cache when there (no model loads), else sampled once and cached."""
    s = SelfSettings.from_node(node, field)
    model = s.model or target
    if not model:
        raise ConfigError(
            "dataset source 'self' samples queries from the target: this stage gave none; set "
            f"{field}.model to a checkpoint folder or hub name"
        )
    who = f"{field}.model" if s.model else "pair.target"  # where an error points
    if s.model or tokenizer is None:  # the template is the sampling model's own
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except OSError as e:
            raise ConfigError(f"{who}={model!r}: its tokenizer could not be loaded: {e}") from e
    kwargs = template_kwargs(node)
    header, eot = template_header(tokenizer, s.system, kwargs)
    header_ids = tokenizer(header, add_special_tokens=False).input_ids
    stops = {eot} | ({tokenizer.eos_token_id} - {None})
    device = resolve_device("auto")
    key = {  # everything that decides the queries
        "version": VERSION,
        "model": str(Path(model).expanduser().resolve()) if Path(model).exists() else model,
        "files": target_key(model, None),  # a local model's files by size and mtime
        "settings": asdict(s),
        "template": [str(tokenizer.chat_template), kwargs, header_ids, sorted(stops)],
        "vocab": len(tokenizer),
        "device": device.type,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    path = specdistill_home() / "self_queries" / f"{digest[:24]}.jsonl"
    if not path.exists():
        from filelock import FileLock  # fcntl.flock on POSIX

        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not path.exists():  # else another process sampled them while this one waited
                log.info("sampling %d self queries from %s -> %s", s.count, model, path)
                net = load_model(model, device=device, field=who)
                pad = eot if tokenizer.pad_token_id is None else tokenizer.pad_token_id
                queries = collect_queries(
                    model_sampler(net, header_ids, s, stops, pad),
                    lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                    stops,
                    s,
                    special=_special_ids(tokenizer) - stops,
                    field=field,
                )
                system = [{"role": "system", "content": s.system}] if s.system else []
                rows = [
                    {"id": f"self-{i}", "messages": [*system, {"role": "user", "content": q}]}
                    for i, q in enumerate(queries)
                ]
                text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                atomic_write_text(path, text)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
