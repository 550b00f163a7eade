"""Timing for the validate stage's speed figures: this machine's step costs and its name.

c = drafter (q) step time / target (p) step time, measured with the decoder's own caches at the
length of a real prompt, alternating the two models so load drifts hit both alike. These figures
price rounds in the report (the modeled speedup, the recommended K); no decode reads them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from specdistill.decode.cache import prefill_prompt, sync
from specdistill.decode.draft_length import DraftCosts, costs_from_steps
from specdistill.decode.speculative import SpeculativeDecoder


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
