"""`transformers` assisted generation as an engine (`hf_assisted`, on by default): the library
route a user gets with `generate(assistant_model=drafter)`, timed on validate's prompts.

`generate()` alone against `generate(assistant_model=drafter)` at batch 1 (all HF supports), in
the serving mode, HF's default draft schedule; a drafter with its own tokenizer runs as
universal assisted generation (`assistant_tokenizer`). Where `transformers` refuses the setting
the figure is its one error line. Its rows stand in report.md's figure table: its speedup, and
ours over it. p = target, q = drafter.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from specdistill.data.runtime import spread
from specdistill.decode.cache import sync
from specdistill.decode.speculative import DecoderConfig
from specdistill.decode.universal_assisted import transformers_version, upstream_fault
from specdistill.decode.validate.engines.base import EngineDefaults, EngineRun, Job, ReportPart

log = logging.getLogger(__name__)


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
    ours_greedy_tokens: list[list[int]] | None,
    assistant_tokenizer=None,
) -> dict[str, Any]:
    """`generate()` alone vs `generate(assistant_model=drafter)` on the same prompts, batch 1
    (all HF supports), HF's default schedule; with `assistant_tokenizer`, universal assisted
    generation. Where `transformers` refuses the setting the figure is its one error line.
    `ours_greedy_tokens`: our target-only greedy tokens, compared with `generate()`'s."""
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
        "same_tokens": (plain_tokens == ours_greedy_tokens)
        if s.greedy and ours_greedy_tokens is not None
        else None,
        "schedule": "transformers default (assistant_model=drafter)"
        + (", universal (assistant_tokenizer=)" if assistant_tokenizer is not None else ""),
    }


class HfAssistedEngine(EngineDefaults):
    """`transformers` assisted generation (`hf_assisted=true`, its only setting); `transformers`
    comes with the package, and the pipeline's summary reads HF's speedup from report.json."""

    name = "hf_assisted"

    def run(self, job: Job, ready: None) -> EngineRun:
        """The serving mode on the loaded pair; its speedup against ours."""
        st, ours = job.st, job.beside
        log.info("validate: transformers' assisted generation on the same prompts")
        hf = hf_assisted_speed(
            st.target, st.drafter, st.tok, st.warm, st.batches, ours.decoder, job.repeats,
            ours.greedy_tokens, assistant_tokenizer=st.mapped.draft_tokenizer if st.mapped else None,
        )  # fmt: skip
        if hf.get("speedup"):
            hf["ours_over_hf"] = round(ours.speedup / hf["speedup"], 3)
        return EngineRun(hf, [])

    def report(self, record: Mapping[str, Any]) -> ReportPart:
        """Two rows of the figure table (or its one error line)."""
        h = record.get("hf_assisted")
        if not h:
            return ReportPart([], [])
        if h.get("error"):
            return ReportPart([("HF assisted generation", h["error"])], [])
        speed = (
            f"{h['speedup']}x ({h['assisted_tokens_per_s']['median']} vs "
            f"{h['generate_tokens_per_s']['median']} tokens/s; same tokens as ours: {h['same_tokens']})"
        )
        return ReportPart(
            [("HF assisted generation", speed), ("our speedup / HF's", f"{h['ours_over_hf']}")], []
        )


ENGINE = HfAssistedEngine()
