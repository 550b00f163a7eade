"""The Seq-KD generate stage: run the target p over a prompt set and store its completions.

    python -m specdistill.data.generate pair=toy-tiny output_dir=DIR max_new_tokens=64 batch_size=16

Writes a `datasets` dataset at `output_dir` (`datasets.load_from_disk`), one row per (prompt,
sample): prompt_index, sample_index, prompt, prompt_ids, completion, completion_ids (unpadded,
ending with EOS when generation stopped there), finish_reason ("eos" | "length") and, with
`topk_logprobs=K`, topk_ids/topk_logprobs of shape [len(completion_ids), K]: the target's
temperature-1 log-softmax over the full vocabulary, so distill can train without p resident.
The config that made it is in `generation_config.json` and the dataset's `info.description`.

`backend=hf` (default) decodes with batched `transformers.generate`; `backend=vllm` with one
offline `vllm.LLM` per process (`data/generate/vllm_engine.py`, settings under `vllm.*`): same rows,
chunks and shards, and `result.json` says which backend wrote them.

Shards (ranks, or `shard.index/count`) write atomic chunks (`data/generate/shards.py`); a killed run
resumes with the missing chunks only, and the last shard to finish merges all of them.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdistill.data.generate import vllm_engine as vllm_backend
from specdistill.data.generate.batched import GenerationSettings, PreparedPrompt, generate_rows
from specdistill.data.generate.shards import (
    chunk_is_complete,
    chunk_path,
    chunk_seed,
    claim_output_dir,
    fingerprint,
    merge_shards,
    plan_shard,
    resolve_shard,
    shard_dir,
    shard_records,
    write_chunk,
    write_done,
)
from specdistill.data.io import read_json
from specdistill.data.models.pairs import PairSpec, load_role, load_tokenizer, resolve_pair
from specdistill.data.prompts import Prompt, check_long_prompts, fit_to_context, load_prompts
from specdistill.data.runtime import (
    ConfigError,
    parse_dtype,
    resolve_device,
    run_or_exit,
    set_threads,
)
from specdistill.data.sampling import Sampling

log = logging.getLogger(__name__)


@dataclass
class GenerateResult:
    """What one process did; `result` is result.json when this process saw the merge done."""

    output_dir: str
    shard_index: int
    shard_count: int
    prompts: int
    samples: int
    chunks_generated: int
    chunks_resumed: int
    new_tokens: int
    tokens_per_s: float
    wall_seconds: float
    merged: bool
    result: dict[str, Any] | None = None


def check_settings(cfg: Any) -> GenerationSettings:
    """Validate the cheap scalar settings before anything is loaded."""

    def positive(field: str) -> int:
        value = int(cfg[field])
        if value <= 0:
            raise ConfigError(f"{field}={value} must be a positive integer, e.g. {field}=64")
        return value

    for field in ("max_new_tokens", "batch_size", "num_samples", "chunk_size"):
        positive(field)
    s = GenerationSettings(
        max_new_tokens=int(cfg.max_new_tokens),
        sampling=Sampling.from_parent(cfg, "sampling"),
        num_samples=int(cfg.num_samples),
        seed=int(cfg.seed),
    )
    if s.num_samples > 1 and not s.do_sample:
        raise ConfigError(
            f"num_samples={s.num_samples} with sampling.temperature=0 (greedy) would store "
            "identical copies: set sampling.temperature > 0 (e.g. 1.0), or num_samples=1"
        )
    if int(cfg.topk_logprobs) < 0:
        raise ConfigError(f"topk_logprobs={cfg.topk_logprobs} must be >= 0 (0: not stored)")
    check_long_prompts(cfg.long_prompts)
    return s


def context_length(model_config: Any, tokenizer: Any) -> int | None:
    """The target's context window, from its config (or the tokenizer's, if it is sane)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else None


def prompt_budget(context: int | None, max_new_tokens: int, max_prompt_tokens: int | None) -> int:
    """Most prompt tokens allowed so that prompt + completion fit the context."""
    room = None if context is None else context - max_new_tokens
    if room is not None and room < 1:
        raise ConfigError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's "
            f"{context}-token context: lower max_new_tokens"
        )
    if max_prompt_tokens is None:
        return room if room is not None else 10**9
    if max_prompt_tokens < 1 or (room is not None and max_prompt_tokens > room):
        raise ConfigError(
            f"max_prompt_tokens={max_prompt_tokens} must be in [1, {room}] (context {context} - "
            f"max_new_tokens {max_new_tokens}), or null for that maximum"
        )
    return max_prompt_tokens


def prepare_prompts(
    prompts: Sequence[Prompt], tokenizer: Any, budget: int, policy: str, add_special_tokens: bool
) -> tuple[list[PreparedPrompt], dict[str, int]]:
    """Tokenize; truncate (keep the end, nearest the completion) or skip prompts over budget,
    or refuse the set (`error`)."""
    out: list[PreparedPrompt] = []
    stats = {"total": len(prompts), "skipped_long": 0, "skipped_empty": 0, "truncated_long": 0}
    encoded = [
        tokenizer(p.text, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts
    ]
    if policy == "error":  # one line naming the count and the fix, before anything is written
        fit_to_context(encoded, budget, policy, context="the target's context leaves")
    for p, ids in zip(prompts, encoded):
        text = p.text
        if not ids:
            stats["skipped_empty"] += 1
            continue
        if len(ids) > budget:
            if policy == "skip":
                stats["skipped_long"] += 1
                continue
            ids = ids[-budget:]
            text = tokenizer.decode(ids)
            stats["truncated_long"] += 1
        out.append(PreparedPrompt(p.index, text, list(ids)))
    return out, stats


def no_prompts_message(stats: dict[str, int], dataset_cfg: Any) -> str:
    """Why no prompt is left, from what `prepare_prompts` counted: an all-empty prompt file is
    not "too long", so the message names the reason that emptied the set (or both)."""
    field = dataset_cfg.get("field", "prompt")
    total, empty, long = stats["total"], stats["skipped_empty"], stats["skipped_long"]
    if empty == total:
        return (
            f"every one of the {total} prompts in dataset.field={field!r} is empty (no tokens): "
            "check dataset.path and dataset.field"
        )
    if long == total:
        return (
            f"every one of the {total} prompts exceeded the context with long_prompts=skip: "
            "use long_prompts=truncate or lower max_new_tokens"
        )
    return (
        f"no prompts left to generate: of {total}, {empty} are empty in "
        f"dataset.field={field!r} and {long} exceeded the context with long_prompts=skip; "
        "check dataset.path/field, or use long_prompts=truncate"
    )


def load_prepared_prompts(
    cfg: Any, tokenizer: Any, budget: int
) -> tuple[list[PreparedPrompt], dict[str, int]]:
    """The stage's prompts, tokenised and fitted to `budget` (the benchmark uses the same)."""
    prompts = load_prompts(cfg.dataset, tokenizer, default_split=str(cfg.split))
    return prepare_prompts(
        prompts,
        tokenizer,
        budget,
        str(cfg.long_prompts),
        add_special_tokens=not is_chat(cfg.dataset),
    )


def is_chat(dataset_cfg: Any) -> bool:
    """Chat prompts already hold the template's special tokens: add none when tokenizing."""
    return bool(dataset_cfg.get("chat", False)) or dataset_cfg.get("field") == "messages"


def config_record(
    cfg: Any,
    spec: PairSpec,
    s: GenerationSettings,
    dtype: torch.dtype,
    budget: int,
    prepared: Sequence[PreparedPrompt],
    stats: dict[str, int],
    shard_count: int,
    output_dir: Path,
) -> dict[str, Any]:
    """Everything that decides the rows; its fingerprint guards resume against config drift."""
    digest = hashlib.sha256(repr([(p.index, p.ids) for p in prepared]).encode()).hexdigest()
    record: dict[str, Any] = {
        "stage": "generate",
        "target": spec.target,
        "revision": spec.revision,
        "tokenizer": spec.tokenizer,
        "toy": spec.toy,
        "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
        "split": cfg.split,
        "sampling": s.record(),
        "topk_logprobs": int(cfg.topk_logprobs),
        "long_prompts": str(cfg.long_prompts),
        "max_prompt_tokens": budget,
        "dtype": str(dtype).removeprefix("torch."),
        "chunk_size": int(cfg.chunk_size),
        "shard_count": shard_count,
        "prompt_digest": digest[:16],
    }
    if str(cfg.get("backend", "hf")) != "hf":  # hf runs keep the fingerprints they always had
        record["backend"] = str(cfg.backend)
    return {
        "fingerprint": fingerprint(record),
        **record,
        "prompt_stats": stats,
        "output_dir": str(output_dir),
    }


def _device_for_rank(name: str) -> torch.device:
    """Under a launcher, rank r of a node uses cuda:LOCAL_RANK; CPU ranks split the cores."""
    device = resolve_device(name)
    local = os.environ.get("LOCAL_RANK")
    if device.type == "cuda" and device.index is None and local is not None:
        return torch.device("cuda", int(local))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if device.type == "cpu" and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return device


def usable_cores() -> int:
    """Cores this process may run on (a Slurm allocation or taskset, not the whole node)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_processes(cfg: Any) -> int:
    """Shard processes to start on this machine (`processes`): auto = one per CPU core (at most
    8) for the hf backend on CPU, else 1. Only a run that no launcher or explicit `shard.*`
    already splits starts any: the shards then come from them."""
    raw = cfg.get("processes", 1)
    if raw == "auto":
        cpu = resolve_device(str(cfg.get("device", "auto"))).type == "cpu"
        n = min(usable_cores(), 8) if cpu and str(cfg.get("backend", "hf")) == "hf" else 1
    elif isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(f"processes={raw!r} must be an integer >= 1 or auto")
    else:
        n = raw
    split = cfg.shard.index is not None or cfg.shard.count is not None
    if n > 1 and (split or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return 1
    if n > 1 and str(cfg.get("backend", "hf")) != "hf":
        raise ConfigError(
            f"processes={raw} starts local hf shards; backend={cfg.backend} batches in one engine: "
            "set processes=1"
        )
    return n


def _shard_process(config: dict[str, Any], results: Any) -> None:
    """A spawned shard of `run_local_processes` (a fresh interpreter: no forked torch state)."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    res = run(OmegaConf.create(config))
    results.put((res.chunks_generated, res.chunks_resumed, res.new_tokens, res.tokens_per_s))


def run_local_processes(cfg: DictConfig, n: int) -> GenerateResult:
    """Shards 1..n-1 in spawned processes, shard 0 here, one thread each by default: on a CPU,
    n single-threaded generate loops outrun one n-threaded loop (figures: data/RESULTS.md,
    "the generate stage on SmolLM2") and never spin-wait on a core another job holds. Each
    shard writes its chunks atomically and the last to finish merges, so a killed run resumes
    with the same command."""
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    children = []
    for i in range(1, n):
        node = OmegaConf.merge(cfg, {"shard": {"index": i, "count": n}, "processes": 1})
        child = ctx.Process(
            target=_shard_process,
            args=(OmegaConf.to_container(node, resolve=True), results),
            daemon=True,
        )
        child.start()
        children.append((i, child))
    try:
        own = run(OmegaConf.merge(cfg, {"shard": {"index": 0, "count": n}, "processes": 1}))
        for _, child in children:
            child.join()
    except BaseException:
        for _, child in children:
            child.terminate()
        raise
    failed = [(i, c.exitcode) for i, c in children if c.exitcode != 0]
    if failed:
        raise RuntimeError(
            f"generate shards {[i for i, _ in failed]} of {n} failed (exit codes "
            f"{[code for _, code in failed]}); finished chunks are kept: rerun the same command "
            "to resume"
        )
    shards = [(own.chunks_generated, own.chunks_resumed, own.new_tokens, own.tokens_per_s)]
    shards += [results.get(timeout=60) for _ in children]
    out = Path(own.output_dir)
    merged = merge_shards(out, wall_seconds=None)  # no-op when a shard already merged
    res = _merged_result(out, merged, time.perf_counter() - t0)
    res.chunks_generated = sum(g for g, _, _, _ in shards)
    res.chunks_resumed = sum(r for _, r, _, _ in shards)
    res.new_tokens = sum(t for _, _, t, _ in shards)
    seconds = max((t / rate for _, _, t, rate in shards if rate), default=0.0)
    res.tokens_per_s = round(res.new_tokens / seconds, 1) if seconds else 0.0
    return res


def run(cfg: DictConfig) -> GenerateResult:
    """Generate this process's shard (resuming), then merge if every shard is finished."""
    t0 = time.perf_counter()
    out = Path(str(cfg.output_dir)).expanduser().absolute()
    if cfg.get("merge_only", False):
        result = merge_shards(out, wall_seconds=None)
        return _merged_result(out, result, time.perf_counter() - t0)
    n = local_processes(cfg)
    if n > 1:
        check_settings(cfg)  # bad settings fail once, here, before any process starts
        return run_local_processes(cfg, n)
    s = check_settings(cfg)
    engine_settings = vllm_backend.backend_settings(cfg)
    index, count = resolve_shard(cfg.shard.index, cfg.shard.count)
    # Only the target runs here (its own tokens): a drafter with another tokenizer is fine.
    spec = resolve_pair(cfg.pair, mapped_ok=True)
    device = _device_for_rank(str(cfg.device))
    set_threads(cfg.get("threads", "default"), device)  # after the per-rank split: it wins
    dtype = parse_dtype(str(cfg.dtype), device)
    tokenizer = load_tokenizer(spec)
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(
        spec.target, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    budget = prompt_budget(
        context_length(model_config, tokenizer), s.max_new_tokens, cfg.max_prompt_tokens
    )
    vocab = getattr(model_config, "vocab_size", None) or len(tokenizer)
    if int(cfg.topk_logprobs) > vocab:
        raise ConfigError(f"topk_logprobs={cfg.topk_logprobs} exceeds the vocabulary ({vocab})")
    prepared, stats = load_prepared_prompts(cfg, tokenizer, budget)
    if not prepared:
        raise ConfigError(no_prompts_message(stats, cfg.dataset))
    engine_len = None
    if engine_settings is not None:  # vLLM's own checks, still before any model loads
        engine_len = vllm_backend.check_target(
            engine_settings,
            model_config,
            device.type == "cpu",
            max(len(p.ids) for p in prepared) + s.max_new_tokens,
            context_length(model_config, tokenizer),
        )
    record = config_record(cfg, spec, s, dtype, budget, prepared, stats, count, out)
    claim_output_dir(out, record, bool(cfg.get("overwrite", False)))

    sdir = shard_dir(out, record["fingerprint"], index, count)
    by_index = {p.index: p for p in prepared}
    plan = plan_shard({p.index: len(p.ids) for p in prepared}, index, count, int(cfg.chunk_size))
    todo = [
        (k, chunk)
        for k, chunk in enumerate(plan)
        if not chunk_is_complete(chunk_path(sdir, k), chunk, s.num_samples)
    ]
    log.info(
        "shard %d/%d: %d prompts in %d chunks, %d already done",
        index,
        count,
        sum(map(len, plan)),
        len(plan),
        len(plan) - len(todo),
    )
    new_tokens, gen_seconds = 0, 0.0
    if todo or not (sdir / "done.json").exists():
        if todo:
            engine = _engine_for(
                cfg, spec, s, device, dtype, tokenizer, engine_settings, engine_len
            )
            new_tokens, gen_seconds = _generate_todo(
                cfg, s, engine, todo, by_index, sdir, index, count
            )
        write_done(
            sdir,
            {
                "fingerprint": record["fingerprint"],
                "shard_index": index,
                "prompt_indices": [i for chunk in plan for i in chunk],
                "rows": sum(map(len, plan)) * s.num_samples,
                "chunks": len(plan),
                "chunks_generated": len(todo),
                "new_tokens": new_tokens,
                "generation_seconds": round(gen_seconds, 3),
                "wall_seconds": round(time.perf_counter() - t0, 3),
                "device": str(device),
            },
        )
    result = None
    if all(r is not None for r in shard_records(out)[1]):
        result = merge_shards(out, wall_seconds=time.perf_counter() - t0)
        log.info("merged %d samples into %s", result["samples"], out)
    else:
        log.info(
            "shard %d/%d done; the last shard to finish merges (or merge_only=true)", index, count
        )
    return GenerateResult(
        output_dir=str(out),
        shard_index=index,
        shard_count=count,
        prompts=sum(map(len, plan)),
        samples=sum(map(len, plan)) * s.num_samples,
        chunks_generated=len(todo),
        chunks_resumed=len(plan) - len(todo),
        new_tokens=new_tokens,
        tokens_per_s=round(new_tokens / gen_seconds, 1) if gen_seconds else 0.0,
        wall_seconds=round(time.perf_counter() - t0, 3),
        merged=result is not None,
        result=result,
    )


RowsFn = Callable[[Sequence[PreparedPrompt], Callable[[int, int], None]], list[dict[str, Any]]]


def _engine_for(
    cfg: Any,
    spec: PairSpec,
    s: GenerationSettings,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Any,
    engine_settings: vllm_backend.EngineSettings | None,
    engine_len: int | None,
) -> RowsFn:
    """Load p on the configured backend; return `rows(prompts, on_batch)` for one chunk."""
    topk = int(cfg.topk_logprobs)
    if engine_settings is None:
        model = load_role(spec, "target", dtype=dtype, device=device)
        return lambda prompts, on_batch: generate_rows(
            model, tokenizer, prompts, s, int(cfg.batch_size), topk, on_batch
        )[0]
    local = os.environ.get("LOCAL_RANK")
    return vllm_backend.rows_fn(
        spec,
        str(dtype).removeprefix("torch."),
        engine_settings,
        int(engine_len or 0),
        s,
        tokenizer,
        topk,
        local_rank=int(local) if local is not None and device.type == "cuda" else None,
    )


def _generate_todo(
    cfg: Any,
    s: GenerationSettings,
    rows_for: RowsFn,
    todo: Sequence[tuple[int, list[int]]],
    by_index: dict[int, PreparedPrompt],
    sdir: Path,
    index: int,
    count: int,
) -> tuple[int, float]:
    """Generate the missing chunks, each written atomically as soon as it is done."""
    total = sum(len(c) for _, c in todo) * s.num_samples
    tokens, seconds = 0, 0.0
    with tqdm(
        total=total,
        unit="seq",
        desc=f"generate {index}/{count}",
        position=index,
        disable=not cfg.get("progress", True),
        dynamic_ncols=True,
    ) as bar:
        tick = time.perf_counter()

        def on_batch(rows: int, new: int) -> None:
            nonlocal tokens
            tokens += new
            bar.update(rows)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - tick):.0f} tok/s")

        for k, chunk in todo:
            torch.manual_seed(chunk_seed(s.seed, index, k))
            rows = rows_for([by_index[i] for i in chunk], on_batch)
            write_chunk(chunk_path(sdir, k), rows, topk=int(cfg.topk_logprobs) > 0)
        seconds = time.perf_counter() - tick
    return tokens, seconds


def _merged_result(out: Path, result: dict[str, Any], wall: float) -> GenerateResult:
    config = read_json(out / "generation_config.json")
    return GenerateResult(
        output_dir=str(out),
        shard_index=0,
        shard_count=int(config["shard_count"]),
        prompts=int(result["prompts"]),
        samples=int(result["samples"]),
        chunks_generated=0,
        chunks_resumed=0,
        new_tokens=0,
        tokens_per_s=0.0,
        wall_seconds=round(wall, 3),
        merged=True,
        result=result,
    )


@hydra.main(config_path="pkg://specdistill.conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """CLI: bad input is one clean line on stderr and exit status 2, not a traceback."""
    res = run_or_exit(run, cfg)
    status = "merged" if res.merged else "waiting for other shards"
    print(
        f"shard {res.shard_index}/{res.shard_count}: {res.samples} samples, "
        f"{res.new_tokens} new tokens at {res.tokens_per_s} tok/s; {status}: {res.output_dir}"
    )


if __name__ == "__main__":
    main()
