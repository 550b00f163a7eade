"""Timing helpers for the validate stage: c from single steps, and HF assisted generation.

c = drafter (q) step time / target (p) step time, measured with the decoder's own caches at the
length of a real prompt, alternating the two models so CPU load drifts hit both alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from specdistill.data.runtime import spread
from specdistill.decode.acceptance import best_gamma, theoretical_speedup
from specdistill.decode.speculative import DecodeOutput, DecoderConfig, SpeculativeDecoder


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_c(
    dec: SpeculativeDecoder,
    input_ids: torch.Tensor,
    iters: int,
    gamma: int,
    slots: int | None = None,
) -> tuple[float, float]:
    """(c, verify_cost): median 1-token step times of q over p, and the (gamma+1)-token verify
    step of p in units of its 1-token step (the speedup formula assumes 1).

    Each sample times a block of gamma+1 steps, as a decode round runs them: 1-token steps
    back to back (the cache grows, then is rolled back), verify steps each rolled back. On a
    shared CPU a lone 1-2 ms drafter step often fits in one scheduler slice while a longer target
    step is preempted, which made single-step medians understate c several times over (toy
    pair under load: decode/RESULTS.md, 2026-11-23 "decoder step modes"); blocks of similar length
    are preempted alike. `slots`: the decode's own cache size (`spec_slots`), so compiled steps
    reuse the decode's graphs instead of compiling a smaller bucket's."""
    ids = input_ids.to(dec.device)
    k = gamma + 1
    timer = dec.step_timer(ids, slots or ids.shape[1] + k + 2)
    times: dict[str, list[float]] = {"target": [], "drafter": [], "verify": []}
    for i in range(iters + 2):  # the first two are warm-up
        tt = timer.forward("target", 1, k, grow=True)
        td = timer.forward("drafter", 1, k, grow=True)
        tv = timer.forward("target", k, k)
        if i >= 2:
            times["target"].append(tt)
            times["drafter"].append(td)
            times["verify"].append(tv)
    t_target = statistics.median(times["target"])
    return statistics.median(times["drafter"]) / t_target, statistics.median(
        times["verify"]
    ) / t_target


@torch.inference_mode()
def verify_costs(
    dec: SpeculativeDecoder, input_ids: torch.Tensor, gammas: list[int], iters: int = 4
) -> dict[int, float]:
    """The target's (gamma+1)-token verify step in its 1-token steps, per gamma (median over
    `iters` samples, each a 1-token block beside a verify block, as the decoder runs them)."""
    ids = input_ids.to(dec.device)
    timer = dec.step_timer(ids, ids.shape[1] + max(gammas) + 1 + 2)
    ratios: dict[int, list[float]] = {g: [] for g in gammas}
    for i in range(iters + 1):  # the first pass warms the shapes up
        for g in gammas:
            one, many = timer.forward("target", 1, 2), timer.verify(g, 2)
            if i:
                ratios[g].append(many / one)
    return {g: statistics.median(r) for g, r in ratios.items()}


def auto_gamma(
    dec: SpeculativeDecoder, probe: torch.Tensor, alpha: float, c: float, max_gamma: int
) -> tuple[int, str]:
    """`gamma: auto`: the best gamma for a pilot's alpha and c, with each candidate's verify
    cost measured (candidates: gammas within 20% of the best by the formula, at most 8)."""
    top = theoretical_speedup(alpha, best_gamma(alpha, c, max_gamma), c)
    near = [g for g in range(1, max_gamma + 1) if theoretical_speedup(alpha, g, c) >= 0.8 * top]
    verify = verify_costs(dec, probe, sorted(set([1, *near]))[:8])
    gamma = best_gamma(alpha, c, max_gamma, verify)
    costs = ", ".join(f"{g}: {v:.2f}" for g, v in verify.items())
    return (
        gamma,
        f"gamma=auto picked {gamma} (pilot alpha {alpha:.3f}, c {c:.3f}; verify costs {costs})",
    )


@torch.inference_mode()
def forward_cost(dec: SpeculativeDecoder, input_ids: torch.Tensor, width: int, iters: int) -> float:
    """One drafter forward of `width` tokens in target 1-token steps (median of blocks of
    alternating timings, both caches at the prompt's length, as `measure_c` does)."""
    ids = input_ids.to(dec.device)
    timer = dec.step_timer(ids, ids.shape[1] + width + 2)
    ratios = []
    for i in range(iters + 2):
        tt, td = timer.forward("target", 1, 4), timer.forward("drafter", width, 4)
        if i >= 2:
            ratios.append(td / tt)
    return statistics.median(ratios)


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
    (HF assisted generation supports no more), HF's default assistant schedule. With
    `assistant_tokenizer` (a drafter q with its own tokenizer) it is universal assisted
    generation (`tokenizer=`, `assistant_tokenizer=`: text re-tokenized both ways); where
    `transformers` refuses the setting (e.g. sampling) the figure is that one error line."""
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
        _sync(device)
        t0 = time.perf_counter()
        for ids in rows:
            ids = ids.to(device)
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), **kw, **extra)
            new = gen[0, ids.shape[1] :].tolist()
            out.append(new)
            n += len(new)
        _sync(device)
        return _rate(n, time.perf_counter() - t0), out

    w = warm[0][0].to(device)
    target.generate(w, attention_mask=torch.ones_like(w), **kw)
    try:
        target.generate(w, attention_mask=torch.ones_like(w), **assist, **kw)
    except (ValueError, TypeError, NotImplementedError) as e:
        if assistant_tokenizer is None:
            raise
        return {"speedup": None, "error": f"transformers refused: {str(e).splitlines()[0]}"}
    plain, assisted, plain_tokens = [], [], None
    for _ in range(repeats):
        r, toks = one_pass(False)
        plain.append(r)
        plain_tokens = plain_tokens or toks
        assisted.append(one_pass(True)[0])
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
