"""On-policy rollouts (`lmbda > 0`) through vLLM: the drafter's own completions from an engine
that holds the drafter's current weights, instead of `transformers.generate`.

On-policy distillation samples from the drafter every on-policy micro-batch, and at scale that
sampling is the step's cost: `generate` decodes a micro-batch row by row at its longest reply,
while vLLM batches continuously (TRL's GKD trainers use it the same way). The engine is built
once per process from the drafter's folder (its config and tokenizer; the weights are replaced
before the first use), and before the first rollout of each optimizer step the trained weights
are loaded into it in place (the worker's `reload_weights`: no restart, and a copy of a small
drafter's weights). Each row is sampled with its own seed from (micro-batch seed, row), so a
resumed run draws the rollouts an uninterrupted one would. Greedy rollouts equal the drafter's
`generate` output on the same weights (tested); sampled ones follow vLLM's sampler, so they are
a different draw than `transformers` gives for the same seed.

`onpolicy.engine`: `auto` takes vLLM on CUDA where it is installed and `transformers` otherwise;
`vllm` insists; `auto` stays in transformers where vLLM could not serve (`asked_engine`). Several training processes (DDP, ZeRO-1/2) each hold their own engine, built
with vLLM's `external_launcher` inside the rank the launcher started (TRL's colocated mode): in
process, on the rank's device, beside the trainer's process group, with a vLLM world of one
(tensor parallel 1), so no rank ever waits on another's rollouts. Refused up front: ZeRO-3 and
FSDP2 (the weights are sharded), a drafter with its own tokenizer or a parallel drafter (their
rollouts are not plain autoregressive ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.distill.train.example import Example
from specdistill.distill.train.onpolicy import end_completion

ENGINES = ("auto", "transformers", "vllm")
ASKED_BY = "onpolicy.engine=vllm"


def resolve_engine(engine: str, lmbda_used: bool, cuda: bool) -> str:
    """`transformers` or `vllm`: what `onpolicy.engine` means on this machine. `auto` takes vLLM
    on CUDA when it imports; nothing needs an engine when no batch is on-policy."""
    if engine not in ENGINES:
        raise ConfigError(f"onpolicy.engine={engine!r}: choose one of {list(ENGINES)}")
    if not lmbda_used or engine == "transformers":
        return "transformers"
    if engine == "auto":
        if not cuda:
            return "transformers"
        try:
            import vllm  # noqa: F401
        except Exception:  # not installed, or a broken install: generate as before
            return "transformers"
        return "vllm"
    from specdistill.data.generate.vllm_engine import require_vllm

    require_vllm(ASKED_BY)
    return "vllm"


def vllm_refusal(zero_stage: int, mapped: bool, parallel: bool, fsdp: bool = False) -> str | None:
    """Why vLLM rollouts cannot serve this distill config (None: they can)."""
    return (
        "ZeRO-3 shards the drafter's weights" if zero_stage == 3
        else "FSDP2 shards the drafter's weights" if fsdp
        else "a drafter with its own tokenizer samples through the vocabulary mapping" if mapped
        else "a parallel drafter's rollouts are not plain autoregressive ones" if parallel
        else None
    )  # fmt: skip


def check_rollouts(zero_stage: int, mapped: bool, parallel: bool, fsdp: bool = False) -> None:
    """What vLLM rollouts cannot serve, one line each, before anything loads."""
    why = vllm_refusal(zero_stage, mapped, parallel, fsdp)
    if why:
        raise ConfigError(f"{ASKED_BY}: {why}; set onpolicy.engine=transformers")


def asked_engine(
    engine: str, lmbda_used: bool, zero_stage: int, mapped: bool, parallel: bool, fsdp: bool
) -> str:
    """What `onpolicy.engine` asks for, from the config alone (the pipeline's plan runs it too):
    `auto` keeps rollouts in transformers where vLLM could not serve them (sharded weights, a
    mapped or parallel drafter), so it never turns into a refusal on a CUDA machine; `vllm`
    there is refused now (check_rollouts). `resolve_engine` then decides `auto` by machine."""
    if engine not in ENGINES:
        raise ConfigError(f"onpolicy.engine={engine!r}: choose one of {list(ENGINES)}")
    if not lmbda_used:
        return "transformers"
    if engine == "vllm":
        check_rollouts(zero_stage, mapped, parallel, fsdp)
    elif engine == "auto" and vllm_refusal(zero_stage, mapped, parallel, fsdp):
        return "transformers"
    return engine


@dataclass
class VLLMRollouts:
    """The drafter in a vLLM engine, its weights refreshed once per optimizer step."""

    engine: Any
    synced_step: int = -1

    @classmethod
    def build(
        cls,
        spec: Any,
        dtype: str,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        processes: int = 1,
    ):
        """An engine on the drafter's folder (the generate backend's engine settings); with
        several training `processes`, one per rank under their launcher."""
        from omegaconf import OmegaConf

        from specdistill.data.generate.vllm_engine import build_engine, check_engine_settings

        node = {
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.3,  # beside the training process's own memory
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "enforce_eager": True,
            "cpu_kvcache_gib": 1,
            "in_process": None,
        }
        settings = check_engine_settings(OmegaConf.create(node))
        # the drafter's folder as the engine's model; the tokenizer is the pair's (shared ids)
        drafter = SimpleNamespace(
            target=str(spec.drafter),
            revision=spec.drafter_revision,
            tokenizer=spec.tokenizer or str(spec.target),
            trust_remote_code=spec.trust_remote_code,
        )
        engine = build_engine(
            drafter, dtype, settings, max_model_len, 0, seed, external_launcher=processes > 1
        )
        return cls(engine)

    def close(self) -> None:
        """Shut the engine down before the trainer ends its process group (the engine's
        in-process worker holds a torch.distributed group of its own)."""
        from specdistill.data.generate.vllm_engine import shutdown_engine

        shutdown_engine()

    def sync(self, model: Any, step: int) -> None:
        """Load `model`'s current weights into the engine, once per optimizer step."""
        if self.synced_step == step:
            return
        weights = [(k, v.detach()) for k, v in model.state_dict().items()]
        self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.synced_step = step

    def sample(
        self,
        model: Any,
        step: int,
        examples: list[Example],
        *,
        pad_id: int,
        eos_id: int | None,
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
    ) -> list[Example]:
        """`onpolicy.sample_onpolicy`'s result, sampled by the engine (row i seeded from seed, i)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from specdistill.data.generate.vllm_engine import completion_of

        self.sync(model, step)
        kw: dict[str, Any] = {"temperature": 0.0}
        params = []
        for i in range(len(examples)):
            if not sampling.greedy:
                kw = {**sampling.as_dict(), "seed": (seed * 1_000_003 + i) % (2**31 - 1)}
            params.append(
                SamplingParams(
                    n=1,
                    max_tokens=max_new_tokens,
                    # the one EOS `generate` is given (eos_token_id), not the model's others
                    stop_token_ids=[] if eos_id is None else [eos_id],
                    ignore_eos=True,
                    detokenize=False,
                    **kw,
                )
            )
        outs = self.engine.generate(
            [TokensPrompt(prompt_token_ids=list(e.prompt_ids)) for e in examples],
            params,
            use_tqdm=False,
        )
        eos = [] if eos_id is None else [eos_id]
        return [
            # the stop token vLLM leaves out put back, then generate's own cut (data.py)
            Example(
                e.prompt_ids, end_completion(completion_of(o.outputs[0], eos)[0], pad_id, eos_id)
            )
            for e, o in zip(examples, outs, strict=True)
        ]
