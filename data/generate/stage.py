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

`run` types its config once (`settings.py`), starts local shard processes where asked
(`shard_processes.py`), checks the pair and fits the prompts to the target's context before any
weights load (`prepare_shard`, `fitted_prompts.py`), then generates its shard (`generate_shard`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdistill.data.chat_prompts import prefetch_self_queries, self_sources
from specdistill.data.generate import vllm_engine as vllm_backend
from specdistill.data.generate.batched import PreparedPrompt, generate_rows
from specdistill.data.generate.fitted_prompts import (
    ChatSet,
    context_length,
    load_prepared_prompts,
    no_prompts_message,
    prompt_budget,
)
from specdistill.data.generate.merge import merge_shards
from specdistill.data.generate.result import GenerateResult, merged_result
from specdistill.data.generate.settings import GenerateSettings, removed_keys
from specdistill.data.generate.shard_processes import (
    device_for_rank,
    local_processes,
    run_local_processes,
)
from specdistill.data.generate.shards import (
    chunk_is_complete,
    chunk_path,
    chunk_seed,
    claim_output_dir,
    fingerprint,
    plan_shard,
    resolve_shard,
    shard_dir,
    shard_records,
    write_chunk,
    write_done,
)
from specdistill.data.generate.turns import read_answers, turn_plan, turn_prompts
from specdistill.data.models.pairs import PairSpec, load_role, load_tokenizer, resolve_pair
from specdistill.data.prompts import check_prompt_settings
from specdistill.data.runtime import (
    ConfigError,
    parse_dtype,
    required,
    run_or_exit,
    set_threads,
)
from specdistill.data.stage_config import check_command_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """This process's share of the run, checked and claimed: what generating it needs."""

    index: int
    count: int
    fingerprint: str  # the config record's: names the folder of this config's chunks
    prompts: list[PreparedPrompt]
    spec: PairSpec
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    engine_len: int | None  # backend=vllm: the engine's max_model_len; None for hf
    budget: int = 0  # prompt tokens allowed (a chat set's later turns are fitted to it)
    chat: ChatSet | None = None  # a chat set: every assistant turn is regenerated in order


def config_record(
    dataset_cfg: Any,
    s: GenerateSettings,
    spec: PairSpec,
    dtype: torch.dtype,
    budget: int,
    prepared: Sequence[PreparedPrompt],
    stats: dict[str, int],
    shard_count: int,
    chat: ChatSet | None = None,
) -> dict[str, Any]:
    """Everything that decides the rows; its fingerprint guards resume against config drift."""
    digest = hashlib.sha256(repr([(p.index, p.ids) for p in prepared]).encode()).hexdigest()
    record: dict[str, Any] = {
        "stage": "generate",
        "target": spec.target,
        "revision": spec.revision,
        "tokenizer": spec.tokenizer,
        "toy": spec.toy,
        "dataset": OmegaConf.to_container(dataset_cfg, resolve=True),
        "split": s.split,
        "sampling": s.generation.record(),
        "topk_logprobs": s.topk_logprobs,
        "long_prompts": s.long_prompts,
        "max_prompt_tokens": budget,
        "dtype": str(dtype).removeprefix("torch."),
        "chunk_size": s.chunk_size,
        "shard_count": shard_count,
        "prompt_digest": digest[:16],
    }
    if s.backend != "hf":  # hf runs keep the fingerprints they always had
        record["backend"] = s.backend
    if chat is not None:  # chat sets: every turn regenerated, rows numbered by turn
        record["chat_turns"] = chat.max_turns
        record["chat_template_kwargs"] = chat.kwargs
    return {
        "fingerprint": fingerprint(record),
        **record,
        "prompt_stats": stats,
        "output_dir": str(s.output_dir),
    }


def run(cfg: DictConfig) -> GenerateResult:
    """Generate this process's shard (resuming), then merge if every shard is finished."""
    t0 = time.perf_counter()
    if required(cfg, "merge_only"):  # a merge reads only what the shards wrote, no setting
        out = Path(str(cfg.output_dir)).expanduser().absolute()
        return merged_result(out, merge_shards(out, wall_seconds=None), time.perf_counter() - t0)
    s = GenerateSettings.from_cfg(cfg)  # bad settings fail once, here, before any process starts
    check_prompt_settings(cfg.dataset)
    n = local_processes(s)
    if n > 1:
        if self_sources(cfg.dataset):  # sampled once here with every core; shards read the file
            spec = resolve_pair(cfg.pair, mapped_ok=True)
            prefetch_self_queries(cfg.dataset, spec.target, load_tokenizer(spec))
        return run_local_processes(cfg, n, run)
    shard = prepare_shard(cfg, s)
    return generate_shard(s, shard, t0)


def prepare_shard(cfg: DictConfig, s: GenerateSettings) -> Shard:
    """Every check that needs the machine, the pair or the prompts, then the output folder
    claimed for this config: all before any weights load (the target's config only)."""
    if s.engine is not None:
        vllm_backend.require_vllm()
    index, count = resolve_shard(s.shard_index, s.shard_count)
    # Only the target runs here (its own tokens): a drafter with another tokenizer is fine.
    spec = resolve_pair(cfg.pair, mapped_ok=True)
    device = device_for_rank(s.device)
    set_threads(s.threads, device)  # after the per-rank split: it wins
    dtype = parse_dtype(s.dtype, device)
    tokenizer = load_tokenizer(spec)
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(
        spec.target, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    context = context_length(model_config, tokenizer)
    budget = prompt_budget(context, s.generation.max_new_tokens, s.max_prompt_tokens)
    vocab = getattr(model_config, "vocab_size", None) or len(tokenizer)
    if s.topk_logprobs > vocab:
        raise ConfigError(f"topk_logprobs={s.topk_logprobs} exceeds the vocabulary ({vocab})")
    prepared, stats, chat = load_prepared_prompts(
        cfg.dataset, tokenizer, budget, s.split, s.long_prompts, target=spec.target
    )
    if not prepared:
        raise ConfigError(no_prompts_message(stats, cfg.dataset))
    engine_len = None
    if s.engine is not None:  # vLLM's own checks, still before any model loads
        engine_len = vllm_backend.check_target(
            s.engine,
            model_config,
            device.type == "cpu",
            max(len(p.ids) for p in prepared) + s.generation.max_new_tokens,
            context,
        )
    record = config_record(cfg.dataset, s, spec, dtype, budget, prepared, stats, count, chat)
    claim_output_dir(s.output_dir, record, s.overwrite)
    return Shard(
        index,
        count,
        record["fingerprint"],
        prepared,
        spec,
        device,
        dtype,
        tokenizer,
        engine_len,
        budget,
        chat,
    )


def shard_plan(s: GenerateSettings, shard: Shard) -> list[tuple[int, list[int]]]:
    """(turn, row ids) chunks of this shard: its prompts' chunks (turn 1), and for a chat set
    each later turn of its conversations after them (`data/generate/turns.py`)."""
    if shard.chat is None or shard.chat.max_turns == 1:
        lengths = {p.index: len(p.ids) for p in shard.prompts}
        return [(1, c) for c in plan_shard(lengths, shard.index, shard.count, s.chunk_size)]
    lengths = {int(p.conversation): len(p.ids) for p in shard.prompts}  # type: ignore[arg-type]
    chunks = plan_shard(lengths, shard.index, shard.count, s.chunk_size)
    turns = {c: len(conv.turns) for c, conv in shard.chat.conversations.items()}
    return turn_plan(chunks, turns, shard.chat.max_turns, s.chunk_size)


def generate_shard(s: GenerateSettings, shard: Shard, t0: float) -> GenerateResult:
    """Generate the shard's missing chunks, mark it done, and merge if it was the last."""
    out, index, count = s.output_dir, shard.index, shard.count
    sdir = shard_dir(out, shard.fingerprint, index, count)
    turn_chunks = shard_plan(s, shard)
    plan = [chunk for _, chunk in turn_chunks]
    num_samples = s.generation.num_samples
    todo = [
        (k, turn, chunk)
        for k, (turn, chunk) in enumerate(turn_chunks)
        if not chunk_is_complete(chunk_path(sdir, k), chunk, num_samples)
    ]
    prompts = sum(map(len, plan))
    log.info(
        "shard %d/%d: %d prompts in %d chunks, %d already done",
        index,
        count,
        prompts,
        len(plan),
        len(plan) - len(todo),
    )
    new_tokens, gen_seconds = 0, 0.0
    cuts = {"turn_prompts_cut": 0, "turns_dropped": 0}
    if todo or not (sdir / "done.json").exists():
        if todo:
            new_tokens, gen_seconds = _generate_todo(
                s, _engine_for(s, shard), todo, _prompts_for(shard, sdir, cuts), sdir, index, count
            )
        write_done(
            sdir,
            {
                "fingerprint": shard.fingerprint,
                "shard_index": index,
                "prompt_indices": [i for chunk in plan for i in chunk],
                "rows": prompts * num_samples,
                "chunks": len(plan),
                "chunks_generated": len(todo),
                "new_tokens": new_tokens,
                "generation_seconds": round(gen_seconds, 3),
                "wall_seconds": round(time.perf_counter() - t0, 3),
                "device": str(shard.device),
                **(cuts if shard.chat is not None else {}),
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
        prompts=prompts,
        samples=prompts * num_samples,
        chunks_generated=len(todo),
        chunks_resumed=len(plan) - len(todo),
        new_tokens=new_tokens,
        tokens_per_s=round(new_tokens / gen_seconds, 1) if gen_seconds else 0.0,
        wall_seconds=round(time.perf_counter() - t0, 3),
        merged=result is not None,
        result=result,
    )


ChunkRows = Iterator[tuple[int, list[dict[str, Any]]]]
StreamFn = Callable[[vllm_backend.Chunks, vllm_backend.OnBatch], ChunkRows]


def _engine_for(s: GenerateSettings, shard: Shard) -> StreamFn:
    """Load p on the configured backend; return `stream(chunks, on_batch)`: (chunk index,
    prompts) pairs in, each chunk's rows out when they are done. `hf` generates chunk by chunk
    (its batches are `batch_size` prompts of one chunk, seeded per chunk); vLLM keeps its
    scheduler full across chunks (`vllm_engine.stream_rows_vllm`)."""
    g, topk = s.generation, s.topk_logprobs
    if s.engine is None:
        model = load_role(shard.spec, "target", dtype=shard.dtype, device=shard.device)

        def stream(chunks: vllm_backend.Chunks, on_batch: vllm_backend.OnBatch) -> ChunkRows:
            for k, prompts in chunks:
                torch.manual_seed(chunk_seed(g.seed, shard.index, k))
                rows, _ = generate_rows(
                    model, shard.tokenizer, prompts, g, s.batch_size, topk, on_batch
                )
                yield k, rows

        return stream
    local = os.environ.get("LOCAL_RANK")
    return vllm_backend.stream_fn(
        shard.spec,
        str(shard.dtype).removeprefix("torch."),
        s.engine,
        int(shard.engine_len or 0),
        g,
        shard.tokenizer,
        topk,
        local_rank=int(local) if local is not None and shard.device.type == "cuda" else None,
    )


PromptsFn = Callable[[int, list[int]], list[PreparedPrompt]]


def _prompts_for(shard: Shard, sdir: Path, cuts: dict[str, int]) -> PromptsFn:
    """`prompts(turn, rows)`: turn 1's prepared prompts; a later turn's rendered after the
    target's own replies in this shard's finished chunks (read when the turn starts), its cuts
    counted into `cuts`."""
    by_index = {p.index: p for p in shard.prompts}
    answers: dict[int, str] = {}
    read_for = 0

    def prompts(turn: int, rows: list[int]) -> list[PreparedPrompt]:
        nonlocal answers, read_for
        if turn == 1 or shard.chat is None:
            return [by_index[i] for i in rows]
        if read_for != turn:  # every earlier turn is on disk: its chunks come first in the plan
            answers, read_for = read_answers(sorted(sdir.glob("chunk-*.parquet"))), turn
        chat = shard.chat
        out, stats = turn_prompts(
            shard.tokenizer,
            chat.conversations,
            chat.kwargs,
            rows,
            chat.max_turns,
            answers,
            shard.budget,
        )
        for key, value in stats.items():
            cuts[key] += value
        return out

    return prompts


def _generate_todo(
    s: GenerateSettings,
    stream: StreamFn,
    todo: Sequence[tuple[int, int, list[int]]],
    prompts_for: PromptsFn,
    sdir: Path,
    index: int,
    count: int,
) -> tuple[int, float]:
    """Generate the missing chunks, each written atomically as soon as it is done (in the
    order they finish); a later turn's chunks start once every earlier turn's are on disk."""
    total = sum(len(c) for *_, c in todo) * s.generation.num_samples
    tokens, seconds = 0, 0.0
    with tqdm(
        total=total,
        unit="seq",
        desc=f"generate {index}/{count}",
        position=index,
        disable=not s.progress,
        dynamic_ncols=True,
    ) as bar:
        tick = time.perf_counter()

        def on_batch(rows: int, new: int) -> None:
            nonlocal tokens
            tokens += new
            bar.update(rows)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - tick):.0f} tok/s")

        for turn, group in itertools.groupby(todo, key=lambda t: t[1]):
            chunks = [(k, prompts_for(turn, chunk)) for k, _, chunk in group]
            chat = {k: prompts[0].conversation is not None for k, prompts in chunks}
            for k, rows in stream(chunks, on_batch):
                write_chunk(chunk_path(sdir, k), rows, topk=s.topk_logprobs, chat=chat[k])
        seconds = time.perf_counter() - tick
    return tokens, seconds


@hydra.main(config_path="pkg://specdistill.conf", config_name="generate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """CLI: bad input is one clean line on stderr and exit status 2, not a traceback."""
    res = run_or_exit(run, cfg)
    status = "merged" if res.merged else "waiting for other shards"
    print(
        f"shard {res.shard_index}/{res.shard_count}: {res.samples} samples, "
        f"{res.new_tokens} new tokens at {res.tokens_per_s} tok/s; {status}: {res.output_dir}"
    )


def main() -> None:
    """`python -m specdistill.data.generate`: a removed or unknown key on the command line is one
    `error:` line (exit 2) before Hydra composes the config, then Hydra's main runs the stage."""
    check_command_line("generate", removed_keys())
    _hydra_main()


if __name__ == "__main__":
    main()
