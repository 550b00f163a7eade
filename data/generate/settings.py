"""The generate stage's config typed once: `GenerateSettings.from_cfg(cfg)` at the top of `run`.

conf/generate.yaml is the one home of every key's default, with why (the fields here have none,
so no value is written twice: tests/test_single_default.py); the types and every check of the
stage's own settings live here, so the stage and its benchmark (bench.py, which runs on the same
config) read typed fields instead of parsing nodes again. A config built by hand without a key
is one `error:` line naming it (`data.runtime.required`). The `pair` and `dataset` groups stay
nodes (read by `resolve_pair` and `load_prompts`). What needs the machine, the files or the
target's config (vLLM importable, the shard's rank, the device, the context left for prompts,
`topk_logprobs` within the vocabulary) is checked by `run`, still before any weights load.
`merge_only` is read by `run` before these settings: a merge uses only `output_dir` and what the
shards wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.generate import vllm_engine as vllm_backend
from specdistill.data.generate.batched import GenerationSettings
from specdistill.data.prompts import check_long_prompts
from specdistill.data.runtime import ConfigError, required
from specdistill.data.sampling import Sampling, replaced_keys

_POSITIVE = ("max_new_tokens", "batch_size", "num_samples", "chunk_size")


def removed_keys() -> dict[str, str]:
    """The stage's removed settings (dotted key -> its one-line refusal), refused alike by
    `from_cfg` and the stage's command line (data/stage_config.py): the per-key sampling spelling."""
    return replaced_keys("sampling")


def _sampled_share(cfg: Any) -> float:
    """`sampled_share`, checked: a share in (0, 1]."""
    raw = required(cfg, "sampled_share")
    try:
        share = float(raw)
    except (TypeError, ValueError):
        share = float("nan")
    if isinstance(raw, bool) or not 0.0 < share <= 1.0:
        raise ConfigError(
            f"sampled_share={raw!r} must lie in (0, 1]: the share of prompts sampled "
            "(1: all of them; e.g. 0.5 for a mixed greedy + sampled set)"
        )
    return share


@dataclass(frozen=True)
class GenerateSettings:
    """conf/generate.yaml's own settings, checked (`pair`, `dataset` and `bench` stay nodes).

    `generation` is how the target p decodes (max_new_tokens, sampling, num_samples, seed);
    `engine` is `vllm.*` typed for backend=vllm, None for backend=hf.
    """

    output_dir: Path
    generation: GenerationSettings
    engine: vllm_backend.EngineSettings | None
    backend: str
    split: str
    batch_size: int
    topk_logprobs: int
    chunk_size: int
    long_prompts: str
    max_prompt_tokens: int | None  # None: the context left after max_new_tokens
    device: str
    dtype: str
    threads: Any  # default | auto | N (data.runtime.set_threads checks it)
    processes: int | str  # N or auto (shard_processes.local_processes resolves it)
    progress: bool
    overwrite: bool
    shard_index: int | None  # None: the rank under a launcher, else 0
    shard_count: int | None  # None: the world size, else 1

    @classmethod
    def from_cfg(cls, cfg: Any) -> GenerateSettings:
        """The stage's config (DictConfig) checked and typed; a ConfigError names the field."""
        processes = required(cfg, "processes")
        if processes != "auto" and (
            isinstance(processes, bool) or not isinstance(processes, int) or processes < 1
        ):
            raise ConfigError(f"processes={processes!r} must be an integer >= 1 or auto")
        for field in _POSITIVE:
            value = int(cfg[field])
            if value <= 0:
                raise ConfigError(f"{field}={value} must be a positive integer, e.g. {field}=64")
        generation = GenerationSettings(
            max_new_tokens=int(cfg.max_new_tokens),
            sampling=Sampling.from_parent(cfg, "sampling"),
            num_samples=int(cfg.num_samples),
            seed=int(cfg.seed),
            sampled_share=_sampled_share(cfg),
        )
        if generation.sampled_share < 1.0 and not generation.do_sample:
            raise ConfigError(
                f"sampled_share={generation.sampled_share} with sampling.temperature=0: a mixed "
                "set samples that share of the prompts; set sampling.temperature > 0 (e.g. 1.0)"
            )
        if generation.mixed and generation.num_samples > 1:
            raise ConfigError(
                f"sampled_share={generation.sampled_share} with num_samples="
                f"{generation.num_samples}: the greedy prompts' samples would be identical "
                "copies; use num_samples=1 for a mixed set (or sampled_share=1)"
            )
        if generation.num_samples > 1 and not generation.do_sample:
            raise ConfigError(
                f"num_samples={generation.num_samples} with sampling.temperature=0 (greedy) would "
                "store identical copies: set sampling.temperature > 0 (e.g. 1.0), or num_samples=1"
            )
        if int(cfg.topk_logprobs) < 0:
            raise ConfigError(f"topk_logprobs={cfg.topk_logprobs} must be >= 0 (0: not stored)")
        check_long_prompts(cfg.long_prompts)
        backend = str(required(cfg, "backend"))
        if backend not in vllm_backend.BACKENDS:
            raise ConfigError(
                f"backend={backend!r} is not known; use one of {', '.join(vllm_backend.BACKENDS)}"
            )
        return cls(
            output_dir=Path(str(cfg.output_dir)).expanduser().absolute(),
            generation=generation,
            engine=vllm_backend.check_engine_settings(cfg.vllm) if backend == "vllm" else None,
            backend=backend,
            split=str(cfg.split),
            batch_size=int(cfg.batch_size),
            topk_logprobs=int(cfg.topk_logprobs),
            chunk_size=int(cfg.chunk_size),
            long_prompts=str(cfg.long_prompts),
            max_prompt_tokens=cfg.max_prompt_tokens,
            device=str(required(cfg, "device")),
            dtype=str(required(cfg, "dtype")),
            threads=required(cfg, "threads"),
            processes=processes,
            progress=bool(required(cfg, "progress")),
            overwrite=bool(required(cfg, "overwrite")),
            shard_index=cfg.shard.index,
            shard_count=cfg.shard.count,
        )


@dataclass(frozen=True)
class BenchSettings:
    """conf/generate.yaml's `bench.*`, checked: what bench.py measures on the stage's settings.

    `engine` is `vllm.*` typed when `backends` holds vllm (the stage's `backend` is not used).
    """

    output: Path
    batch_sizes: tuple[int, ...]
    num_prompts: int
    repeats: int  # best of N wall times per mode
    backends: tuple[str, ...]
    engine: vllm_backend.EngineSettings | None

    @classmethod
    def from_cfg(cls, cfg: Any) -> BenchSettings:
        """`cfg.bench` (and `cfg.vllm` for backends=[hf,vllm]) checked and typed."""
        bench = cfg.bench
        sizes = [int(b) for b in bench.batch_sizes]
        if not sizes or min(sizes) <= 0:
            raise ConfigError(f"bench.batch_sizes={sizes} must be positive integers, e.g. [1,8,32]")
        if int(bench.num_prompts) <= 0:
            raise ConfigError(f"bench.num_prompts={bench.num_prompts} must be positive, e.g. 64")
        backends = [str(b) for b in required(bench, "backends", "bench")]
        if not set(backends) <= set(vllm_backend.BACKENDS) or "hf" not in backends:
            raise ConfigError(f"bench.backends={backends} must be [hf] or [hf,vllm]")
        return cls(
            output=Path(str(bench.output)),
            batch_sizes=tuple(sizes),
            num_prompts=int(bench.num_prompts),
            repeats=max(1, int(required(bench, "repeats", "bench"))),
            backends=tuple(backends),
            engine=vllm_backend.check_engine_settings(cfg.vllm) if "vllm" in backends else None,
        )
