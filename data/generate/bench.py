"""Benchmark: the generate stage's batched decoding vs one-prompt-at-a-time `generate`.

    python -m specdistill.data.generate.bench pair=toy-tiny max_new_tokens=64 bench.num_prompts=64

Same target, same prompts, same settings, one process, measured side by side: the baseline
calls `model.generate` on each unpadded prompt alone; the stage's path (`generate_rows`: length-
sorted, left-padded batches) runs at each of `bench.batch_sizes`. Tokens are the completion
tokens kept (through the first EOS), so padding a batch keeps decoding never counts as output.
Greedy runs also check that every batch size reproduces the baseline's tokens exactly.
With `bench.backends=[hf,vllm]` the vLLM backend runs the same prompts too (one engine, all
prompts submitted at once: continuous batching), after a warm-up, beside the hf numbers; greedy
runs report the share of its completions token-identical to the baseline's.
Prints a table and writes `bench.output` (JSON).
"""

from __future__ import annotations

import logging
import platform
import time
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from specdistill.data.generate import vllm_engine as vllm_backend
from specdistill.data.generate.batched import (
    GenerationSettings,
    PreparedPrompt,
    generate_rows,
    generation_config,
    split_completion,
)
from specdistill.data.generate.fitted_prompts import (
    context_length,
    load_prepared_prompts,
    prompt_budget,
)
from specdistill.data.generate.settings import BenchSettings, GenerateSettings
from specdistill.data.io import atomic_write_json
from specdistill.data.models.pairs import load_role, load_tokenizer, resolve_pair
from specdistill.data.runtime import eos_ids, parse_dtype, resolve_device, run_or_exit

log = logging.getLogger(__name__)


@torch.inference_mode()
def one_at_a_time(
    model: Any, tokenizer: Any, prompts: list[PreparedPrompt], s: GenerationSettings
) -> list[list[int]]:
    """The baseline: a plain `generate` per prompt, no padding, no batching."""
    eos = eos_ids(model.generation_config, tokenizer)
    gc = generation_config(s, tokenizer.pad_token_id, eos)
    outs = []
    for p in prompts:
        ids = torch.tensor([p.ids], device=model.device)
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc
        )
        outs.append(split_completion(out[0, len(p.ids) :].tolist(), eos)[0])
    return outs


def _timed(fn: Any, repeats: int) -> tuple[Any, float]:
    """The result and the fastest of `repeats` wall times (a shared machine is noisy)."""
    best, value = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return value, best


def run_bench(cfg: DictConfig) -> dict[str, Any]:
    """Measure both paths on the same prompts; return the report (also written to JSON)."""
    s, b = GenerateSettings.from_cfg(cfg), BenchSettings.from_cfg(cfg)
    if b.engine is not None:
        vllm_backend.require_vllm()
    g = s.generation
    # Only the target runs here (its own tokens): a drafter with another tokenizer is fine.
    spec = resolve_pair(cfg.pair, mapped_ok=True)
    device = resolve_device(s.device)
    dtype = parse_dtype(s.dtype, device)
    tokenizer = load_tokenizer(spec)
    model = load_role(spec, "target", dtype=dtype, device=device)
    budget = prompt_budget(
        context_length(model.config, tokenizer), g.max_new_tokens, s.max_prompt_tokens
    )
    prepared, _, _ = load_prepared_prompts(
        cfg.dataset, tokenizer, budget, s.split, s.long_prompts, target=spec.target
    )
    prepared = prepared[: b.num_prompts]

    torch.manual_seed(g.seed)
    one_at_a_time(model, tokenizer, prepared[:2], g)  # warm-up (allocator, kernels)
    torch.manual_seed(g.seed)
    base, base_s = _timed(lambda: one_at_a_time(model, tokenizer, prepared, g), b.repeats)
    base_tokens = sum(map(len, base))
    baseline = {
        "seconds": round(base_s, 3),
        "tokens": base_tokens,
        "tokens_per_s": round(base_tokens / base_s, 1),
    }
    reference = {p.index: c for p, c in zip(prepared, base)}
    rows_out = _bench_batched(model, tokenizer, prepared, g, b, baseline, reference)
    vllm_entry = None
    if b.engine is not None:
        vllm_entry = _bench_vllm(
            spec, g, dtype, model, tokenizer, prepared, b.engine, b.repeats, s.chunk_size
        )
        _compare_vllm(vllm_entry, g, baseline, rows_out, reference)
    report = {
        "target": spec.target,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "prompts": len(prepared),
        "mean_prompt_tokens": round(sum(len(p.ids) for p in prepared) / len(prepared), 1),
        "max_new_tokens": g.max_new_tokens,
        "do_sample": g.do_sample,
        "repeats": b.repeats,
        "one_at_a_time": baseline,
        "batched": rows_out,
        **({"vllm": vllm_entry} if vllm_entry is not None else {}),
    }
    atomic_write_json(b.output, report)
    return report


def _bench_batched(
    model: Any,
    tokenizer: Any,
    prepared: list[PreparedPrompt],
    s: GenerationSettings,
    b: BenchSettings,
    baseline: dict[str, Any],
    reference: dict[int, list[int]],
) -> list[dict[str, Any]]:
    """The stage's path at each of `bench.batch_sizes`, against the one-at-a-time baseline
    (greedy: whether every completion is the baseline's, token for token)."""
    by_length = sorted(prepared, key=lambda p: (len(p.ids), p.index))  # as the stage batches
    rows_out = []
    for bs in b.batch_sizes:
        torch.manual_seed(s.seed)
        (rows, tokens), secs = _timed(
            lambda bs=bs: generate_rows(model, tokenizer, by_length, s, bs, topk=0), b.repeats
        )
        tps = tokens / secs
        entry = {
            "batch_size": bs,
            "seconds": round(secs, 3),
            "tokens": tokens,
            "tokens_per_s": round(tps, 1),
            "ratio_vs_one_at_a_time": round(tps / baseline["tokens_per_s"], 2),
        }
        if not s.do_sample:
            entry["identical_to_one_at_a_time"] = all(
                r["completion_ids"] == reference[r["prompt_index"]] for r in rows
            )
        rows_out.append(entry)
    return rows_out


def _bench_vllm(
    spec: Any,
    s: GenerationSettings,
    dtype: torch.dtype,
    model: Any,
    tokenizer: Any,
    prepared: list[PreparedPrompt],
    settings: vllm_backend.EngineSettings,
    repeats: int,
    chunk_size: int,
) -> dict[str, Any]:
    """The vLLM backend on the same prompts: engine start, warm-up, then best-of-N wall time,
    all prompts submitted at once; then as the stage feeds it, chunks of `chunk_size` prompts
    (the unit a killed run resumes from): one `generate` call per chunk (the stage before it
    streamed) against the stream that keeps the engine full across chunks."""
    need = max(len(p.ids) for p in prepared) + s.max_new_tokens
    length = vllm_backend.check_target(
        settings,
        model.config,
        model.device.type == "cpu",
        need,
        context_length(model.config, tokenizer),
    )
    t = time.perf_counter()
    engine = vllm_backend.build_engine(
        spec, str(dtype).removeprefix("torch."), settings, length, 0, s.seed
    )
    start_s = time.perf_counter() - t
    eos = eos_ids(model.generation_config, tokenizer)
    vllm_backend.generate_rows_vllm(engine, tokenizer, prepared[:2], s, 0, eos)  # warm-up
    (rows, tokens), secs = _timed(
        lambda: vllm_backend.generate_rows_vllm(engine, tokenizer, prepared, s, 0, eos), repeats
    )
    chunks = [
        (k, prepared[i : i + chunk_size]) for k, i in enumerate(range(0, len(prepared), chunk_size))
    ]

    def per_chunk() -> tuple[None, int]:
        done = [vllm_backend.generate_rows_vllm(engine, tokenizer, c, s, 0, eos) for _, c in chunks]
        return None, sum(t for _, t in done)

    def streamed() -> tuple[None, int]:
        window = 2 * settings.max_num_seqs
        got = vllm_backend.stream_rows_vllm(
            engine.llm_engine, tokenizer, chunks, s, 0, eos, lambda r, t: None, window
        )
        return None, sum(len(r["completion_ids"]) for _, rows in got for r in rows)

    (_, chunk_tokens), chunk_secs = _timed(per_chunk, repeats)
    (_, stream_tokens), stream_secs = _timed(streamed, repeats)
    return {
        "engine_start_seconds": round(start_s, 1),
        "threads": torch.get_num_threads(),
        "seconds": round(secs, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / secs, 1),
        "rows": rows,
        "chunk_size": chunk_size,
        "per_chunk_tokens_per_s": round(chunk_tokens / chunk_secs, 1),
        "streamed_tokens_per_s": round(stream_tokens / stream_secs, 1),
        "streamed_over_per_chunk": round(
            (stream_tokens / stream_secs) / (chunk_tokens / chunk_secs), 2
        ),
    }


def _compare_vllm(
    entry: dict[str, Any],
    s: GenerationSettings,
    baseline: dict[str, Any],
    batched: list[dict[str, Any]],
    reference: dict[int, list[int]],
) -> None:
    """vLLM's ratios to the baseline and the best hf batch size, in `entry`; its rows replaced
    (greedy) by the share of completions token-identical to the baseline's."""
    entry["ratio_vs_one_at_a_time"] = round(entry["tokens_per_s"] / baseline["tokens_per_s"], 2)
    best_hf = max(r["tokens_per_s"] for r in batched)
    entry["ratio_vs_best_hf_batched"] = round(entry["tokens_per_s"] / best_hf, 2)
    rows = entry.pop("rows")
    if not s.do_sample:
        same = [r["completion_ids"] == reference[r["prompt_index"]] for r in rows]
        entry["identical_to_one_at_a_time_share"] = round(sum(same) / len(same), 3)


def format_report(report: dict[str, Any]) -> str:
    head = (
        f"{report['prompts']} prompts, max_new_tokens={report['max_new_tokens']}, "
        f"{report['device']} {report['dtype']}, {report['threads']} threads"
    )
    base = report["one_at_a_time"]
    lines = [head, f"{'mode':<22}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'ratio':>8}"]
    lines.append(
        f"{'one-at-a-time':<22}{base['tokens']:>8}{base['seconds']:>10.2f}"
        f"{base['tokens_per_s']:>10.1f}{1.0:>8.2f}"
    )
    for r in report["batched"]:
        same = {True: "  same tokens", False: "  DIFFERENT tokens"}.get(
            r.get("identical_to_one_at_a_time"), ""
        )
        lines.append(
            f"{'batched bs=' + str(r['batch_size']):<22}{r['tokens']:>8}{r['seconds']:>10.2f}"
            f"{r['tokens_per_s']:>10.1f}{r['ratio_vs_one_at_a_time']:>8.2f}{same}"
        )
    v = report.get("vllm")
    if v is not None:
        share = v.get("identical_to_one_at_a_time_share")
        same = "" if share is None else f"  {share:.0%} same tokens"
        lines.append(
            f"{'vllm':<22}{v['tokens']:>8}{v['seconds']:>10.2f}{v['tokens_per_s']:>10.1f}"
            f"{v['ratio_vs_one_at_a_time']:>8.2f}{same}"
        )
        lines.append(
            f"vllm / best hf batched: {v['ratio_vs_best_hf_batched']:.2f}x "
            f"(engine start {v['engine_start_seconds']:.0f} s, not counted)"
        )
        lines.append(
            f"vllm in chunks of {v['chunk_size']}: streamed {v['streamed_tokens_per_s']:.1f} "
            f"tok/s vs one call per chunk {v['per_chunk_tokens_per_s']:.1f} "
            f"({v['streamed_over_per_chunk']:.2f}x)"
        )
    return "\n".join(lines)


@hydra.main(config_path="pkg://specdistill.conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    report = run_or_exit(run_bench, cfg)
    print(format_report(report))
    print(f"wrote {cfg.bench.output}")


if __name__ == "__main__":
    main()
