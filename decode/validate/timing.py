"""Timing for the validate stage's speed figures: this machine's step costs, HF assisted generation.

c = drafter (q) step time / target (p) step time, measured with the decoder's own caches at the
length of a real prompt, alternating the two models so load drifts hit both alike. These figures
price rounds in the report (the modeled speedup, the recommended K); no decode reads them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch

from specdistill.data.runtime import spread
from specdistill.decode.cache import prefill_prompt, sync
from specdistill.decode.draft_length import DraftCosts, costs_from_steps
from specdistill.decode.speculative import DecodeOutput, DecoderConfig, SpeculativeDecoder
from specdistill.decode.universal_assisted import transformers_version, upstream_fault


@torch.inference_mode()
def step_costs(
    dec: SpeculativeDecoder,
    input_ids: torch.Tensor,
    iters: int,
    gamma: int,
    slots: int | None = None,
    drafter_width: int = 1,
) -> tuple[float, float]:
    """(c, verify_cost) on this machine, for the report only: the median of q's
    `drafter_width`-token step over p's 1-token step, and p's (gamma+1)-token verify in 1-token
    steps, alternated at the prompt's length so load drifts hit both alike. `slots`: the
    decode's cache size (compiled steps then reuse its graphs)."""
    ids = input_ids.to(dec.device)
    k = gamma + 1
    cap = slots or ids.shape[1] + k * 2 + 2
    runners = {
        "target": (dec._runner(dec.target, cap), ids),
        "drafter": (dec._runner(dec.drafter, cap), dec.drafting.drafter_ids(ids)),
    }
    for runner, x in runners.values():
        prefill_prompt([runner], x, torch.ones_like(x, dtype=torch.bool), True)

    def block(name: str, width: int, grow: bool) -> float:
        runner, x = runners[name]
        start, step = runner.length, x[:, -1:].repeat(1, width)
        sync(dec.device)
        t0 = time.perf_counter()
        for _ in range(k):
            runner.forward(step, keep=1)
            if not grow:
                runner.rollback(start)
        sync(dec.device)
        runner.rollback(start)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"target": [], "drafter": [], "verify": []}
    for i in range(iters + 2):  # the first two are warm-up
        sample = (
            block("target", 1, True),
            block("drafter", drafter_width, drafter_width == 1),
            block("target", k, False),
        )
        if i >= 2:
            for name, t in zip(times, sample):
                times[name].append(t)
    one = statistics.median(times["target"])
    return statistics.median(times["drafter"]) / one, statistics.median(times["verify"]) / one


def machine_name(device: torch.device) -> str:
    """The machine a speed figure was measured on, in one line: the GPU's name, or the CPU's
    model and core count (speed figures are this machine's, never a goal by themselves)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def round_costs(
    dec: SpeculativeDecoder, probe: torch.Tensor, iters: int, gamma: int, slots: int | None = None
) -> tuple[float, float, DraftCosts]:
    """(c, verify cost, the cost model) on this machine at the probe's length (`step_costs`); a
    parallel drafter's c is its one forward of gamma+1 tokens a round."""
    width = gamma + 1 if dec.parallel else 1
    c, verify = step_costs(dec, probe, iters, gamma, slots, drafter_width=width)
    return c, verify, costs_from_steps(c, verify, gamma, parallel=dec.parallel)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


@torch.inference_mode()
def hf_assisted_speed(
    target,
    drafter,
    tok,
    warm: list[tuple[torch.Tensor, torch.Tensor]],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: DecoderConfig,
    repeats: int,
    ours_baseline: DecodeOutput | None,
    assistant_tokenizer=None,
) -> dict[str, Any]:
    """`generate()` alone vs `generate(assistant_model=drafter)` on the same prompts, batch 1
    (all HF supports), HF's default schedule; with `assistant_tokenizer`, universal assisted
    generation. Where `transformers` refuses the setting the figure is its one error line."""
    device = next(target.parameters()).device
    rows = [ids[j : j + 1, mask[j].bool()] for ids, mask in batches for j in range(ids.shape[0])]
    s = cfg.sampling
    kw: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "do_sample": not s.greedy,
        "eos_token_id": list(cfg.eos_token_id) or None,
        "pad_token_id": tok.pad_token_id,
    }
    if not s.greedy:
        kw |= {"temperature": s.temperature, "top_k": s.top_k or None, "top_p": s.top_p}

    assist: dict[str, Any] = {"assistant_model": drafter}
    if assistant_tokenizer is not None:
        assist |= {"tokenizer": tok, "assistant_tokenizer": assistant_tokenizer}

    def one_pass(assisted: bool) -> tuple[float, list[list[int]]]:
        extra = assist if assisted else {}
        out, n = [], 0
        sync(device)
        t0 = time.perf_counter()
        for ids in rows:
            ids = ids.to(device)
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), **kw, **extra)
            new = gen[0, ids.shape[1] :].tolist()
            out.append(new)
            n += len(new)
        sync(device)
        return _rate(n, time.perf_counter() - t0), out

    w = warm[0][0].to(device)
    target.generate(w, attention_mask=torch.ones_like(w), **kw)
    plain, assisted, plain_tokens = [], [], None
    try:
        target.generate(w, attention_mask=torch.ones_like(w), **assist, **kw)
        for _ in range(repeats):
            r, toks = one_pass(False)
            plain.append(r)
            plain_tokens = plain_tokens or toks
            assisted.append(one_pass(True)[0])
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        # universal assisted generation is transformers' own path beside ours: where it refuses
        # the setting, or breaks inside (some releases fail to re-tokenize short prompts), the
        # figure is its one error line, not a failed validate
        if assistant_tokenizer is None:
            raise
        fault = upstream_fault(e)
        word = "failed" if isinstance(e, RuntimeError) else "refused"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {
            "speedup": None,
            "error": fault.line()
            if fault
            else f"transformers {transformers_version()} {word}: {first}",
        }
    med = statistics.median(assisted) / statistics.median(plain)
    return {
        "generate_tokens_per_s": spread(plain),
        "assisted_tokens_per_s": spread(assisted),
        "speedup": round(med, 3),
        "same_tokens": (plain_tokens == ours_baseline.tokens)
        if s.greedy and ours_baseline
        else None,
        "schedule": "transformers default (assistant_model=drafter)"
        + (", universal (assistant_tokenizer=)" if assistant_tokenizer is not None else ""),
    }
