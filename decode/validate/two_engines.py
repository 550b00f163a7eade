"""One report, both engines: our decoder's figures and vLLM's, side by side, per serving mode.

Runs the vLLM side (`decode/validate/vllm_engine.py`) on the validate stage's own prompts (the
same token ids, batches, max_new_tokens, gamma and repeats), then puts each mode's acceptance of
both engines on one footing (`decode/validate/agreement.py`) and says where they disagree beyond
sampling noise. p = target, q = drafter. A drafter with its own tokenizer runs as vLLM's TLI
(`use_heterogeneous_vocab`); vLLM's own mapping of the two tokenizers is compared with ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdistill.data.generate.vllm_engine import EngineSettings
from specdistill.data.models.pairs import PairSpec
from specdistill.data.sampling import Sampling
from specdistill.decode.validate.agreement import (
    Acceptance,
    agreement,
    agreement_note,
    same_outputs,
    token_lists,
)
from specdistill.decode.validate.mapped import vllm_mapping_figures
from specdistill.decode.validate.vllm_engine import (
    ENGINE_SHARE,
    engines,
    measure_mode,
    model_len,
    sampled_speculation_defect,
)


def _beside_ours(row: dict[str, Any], mine: dict[str, Any], mode: str) -> str | None:
    """Our decoder's figures in vLLM's `row` of `mode`, both acceptances on one footing
    (agreement.py); the note when they disagree beyond sampling noise. Nothing without our
    per-position counts (`mine`: our row of `modes`)."""
    if mine.get("trials_at") is None:
        return None
    acc = Acceptance.from_ours(mine["accepted_at"], mine["trials_at"])
    vacc = Acceptance.from_vllm(row["counters"]["drafts"], row["counters"]["per_pos"])
    agree = agreement(acc, vacc)
    row["ours"] = acc.figures() | {
        "rounds_accepted": f"{acc.rounds} / {acc.accepted}",
        "tau": mine.get("tau"),
        "alpha": mine.get("alpha"),
        "speedup": mine.get("speedup"),
        "target_only_tokens_per_s": mine.get("baseline_tokens_per_s"),
        "speculative_tokens_per_s": mine.get("speculative_tokens_per_s"),
    }
    row["agreement"] = agree.as_dict()
    return agreement_note(mode, agree)


def validate_in_vllm(
    spec: PairSpec,
    settings: EngineSettings,
    target_config: Any,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    samplings: dict[str, Sampling],
    ours: dict[str, dict[str, Any]],
    ours_greedy_tokens: list[list[int]] | None,
    *,
    gamma: int,
    max_new_tokens: int,
    repeats: int,
    seed: int,
    dtype: torch.dtype,
    eos: Sequence[int],
    draft_sample_method: str | None = None,
    parallel_drafting: bool = False,
    mapped: Any = None,
) -> tuple[dict[str, Any], list[str]]:
    """(report.json's `vllm` section, notes): both engines of vLLM in every mode of `samplings`.

    `ours[mode]` is our decoder's row of `modes` (with its `accepted_at` / `trials_at`);
    `mapped`: our decoder's `MappedVocab` when the drafter has its own tokenizer (TLI)."""
    import vllm

    prompts = token_lists(batches)
    need = max(len(p) for b in prompts for p in b) + max_new_tokens + gamma + 1
    length = model_len(settings, target_config, need)
    notes: list[str] = []
    modes: dict[str, dict[str, Any]] = {}
    with engines(
        spec, settings, dtype=str(dtype).removeprefix("torch."), max_model_len=length, seed=seed,
        gamma=gamma, method=draft_sample_method, parallel=parallel_drafting,
    ) as (plain, speculative):  # fmt: skip
        defect = sampled_speculation_defect()  # after the engines: their kernels are registered
        for mode, s in samplings.items():
            row = measure_mode(plain, speculative, prompts, s, max_new_tokens, eos, seed, repeats)
            if defect and not s.greedy:
                row["engine_defect"] = defect
                notes.append(f"{mode}: {defect}")
            plain_tokens = row.pop("plain_tokens")
            note = _beside_ours(row, ours.get(mode) or {}, mode)
            if note:
                notes.append(note)
            if s.greedy and ours_greedy_tokens is not None:
                row["plain_equals_ours_target_only"] = same_outputs(
                    plain_tokens, ours_greedy_tokens, eos
                )
            if s.greedy and not row["identical_to_plain"]:
                notes.append(
                    f"vLLM greedy with the drafter differs from its plain greedy output in "
                    f"{row['mismatched_sequences']} sequences (near-ties in {dtype}?)"
                )
            modes[mode] = row
    result = {
        "version": getattr(vllm, "__version__", "unknown"),
        "method": "draft_model",
        "parallel_drafting": parallel_drafting,
        "use_heterogeneous_vocab": spec.vocab == "mapped",
        "num_speculative_tokens": gamma,
        "draft_sample_method": draft_sample_method or "vLLM's default (greedy)",
        "dtype": str(dtype).removeprefix("torch."),
        "settings": {
            "tensor_parallel_size": settings.tensor_parallel_size,
            "gpu_memory_utilization_per_engine": settings.gpu_memory_utilization * ENGINE_SHARE,
            "enforce_eager": settings.enforce_eager,
            "max_model_len": length,
        },
        "modes": modes,
        "greedy_identical_to_plain": (modes.get("greedy") or {}).get("identical_to_plain"),
    }
    if mapped is not None:
        result["vocab_mapping"] = _mapping_beside_ours(mapped, notes)
    return result, notes


def _mapping_beside_ours(mapped: Any, notes: list[str]) -> dict[str, Any] | None:
    """vLLM's own TLI mapping of the two tokenizers against ours; a note where they differ."""
    m = vllm_mapping_figures(mapped)
    if m and (m["draft_ids_mapped_differently"] or m["target_ids_read_differently"]):
        notes.append(
            f"vLLM's TLI mapping differs from ours on {m['draft_ids_mapped_differently']} "
            f"drafter ids and {m['target_ids_read_differently']} target ids (each engine "
            "maps the tokenizers itself): the engines' acceptance may differ by more than noise"
        )
    return m
