"""Validate's set-up: every check that needs no weights, then the pair loaded and its prompts
fitted to the context and batched (`Setup`, decode/validate/loaded.py).

Bad input fails here before anything loads: the stage's settings, the prompt set, the pair
and its caches, each chosen engine's preflight (decode/validate/engines/), the target-only
cache folder. Then the pair and the held-out prompts (refused where they are training rows),
a multi-turn question's later turns after the target's own answers, batched by length.
p = target, q = drafter.
"""

from __future__ import annotations

from omegaconf import DictConfig

from specdistill.data.dataset_files import check_files
from specdistill.data.heldout_check import check_disjoint
from specdistill.data.models.pairs import load_pair, resolve_pair
from specdistill.data.prompts import check_prompt_settings, fit_prompt_set, load_prompts
from specdistill.data.runtime import (
    ConfigError,
    node_get,
    pad_rows,
    parse_dtype,
    resolve_device,
    set_threads,
)
from specdistill.data.splits import EVAL
from specdistill.decode.cache import check_rollback_config
from specdistill.decode.validate.categories import labels as category_labels
from specdistill.decode.validate.engines import chosen
from specdistill.decode.validate.loaded import Batch, Setup
from specdistill.decode.validate.mapped import load_mapped
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.decode.validate.target_only import TargetOnlyCache, shared_answers
from specdistill.decode.validate.timing import machine_name
from specdistill.decode.validate.turns import expand_turns, greedy_answers, merge_fit


def by_length(prompts: list, rows: list[list[int]]) -> tuple[list, list[list[int]]]:
    """Prompts and their ids in order of length (ties keep the set's order), so a batch holds
    prompts of similar length: a left-padded batch runs every row at its longest prompt's
    length (prefill included), and a speculative batch runs until its slowest row is done."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    return [prompts[i] for i in order], [rows[i] for i in order]


def _batches(rows: list[list[int]], pad_id: int, batch_size: int) -> list[Batch]:
    """Left-padded tensors of already fitted prompt ids."""
    return [pad_rows(rows[i : i + batch_size], pad_id) for i in range(0, len(rows), batch_size)]


def setup(cfg: DictConfig, gamma_room: int, vs: ValidateSettings | None = None) -> Setup:
    """Check the settings, then load the pair and the prompts (bad input fails before loading).

    `vs`: the stage's settings when the caller typed them already (`run` does, at its top)."""
    vs = vs or ValidateSettings.from_cfg(cfg)  # the stage's and the decoder's checks
    check_prompt_settings(cfg.dataset)
    check_files(cfg.dataset, EVAL)  # the prompt files, before the pair loads to read them
    device = resolve_device(vs.device)
    set_threads(vs.threads, device)
    dtype = parse_dtype(vs.dtype, device)
    spec = resolve_pair(cfg.pair, stage="validate", mapped_ok=True)
    for key, name, rev in (
        ("pair.target", spec.target, spec.revision),
        ("pair.drafter", spec.drafter, spec.drafter_revision),
    ):  # refuse an un-rollbackable cache before any weights load
        check_rollback_config(key, name, rev, spec.trust_remote_code)
    ready = {  # every engine's install and config checks, before any weights load
        e.name: e.preflight(cfg, spec, vs.engine_settings.get(e.name))
        for e in chosen(vs.engines, vs.hf_assisted)
    }
    cache = None
    if vs.target_only_cache is not None:  # a folder it cannot write fails here, not after decoding
        cache = TargetOnlyCache.create(
            vs.target_only_cache, spec.target, spec.revision, device, dtype, machine_name(device)
        )
    target, drafter, tok = load_pair(spec, device=device, dtype=dtype)
    mapped = load_mapped(cfg, spec, target, drafter, tok)
    prompts = load_prompts(cfg.dataset, tok, default_split=EVAL, target=spec.target)
    if vs.num_prompts:
        prompts = prompts[: vs.num_prompts]
    check_disjoint(prompts, vs.training_data)
    eos = tuple(sorted({i for i in [tok.eos_token_id] if i is not None}))
    context = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
    room = context - vs.max_new_tokens - gamma_room - 2
    max_prompt = int(vs.max_prompt_tokens or room)
    if max_prompt < 1 or max_prompt > room:
        raise ConfigError(
            f"max_prompt_tokens={max_prompt}: the context ({context}) leaves {room} prompt tokens "
            f"after max_new_tokens={vs.max_new_tokens}; lower max_new_tokens or max_prompt_tokens"
        )
    where = f"the target's {context}-token context leaves after max_new_tokens={vs.max_new_tokens}"

    def fit_set(ps: list) -> tuple:
        return fit_prompt_set(ps, tok, vs.long_prompts, max_prompt, where)

    prompts, rows, fit = fit_set(prompts)
    # a multi-turn question's later turns, after the target's own greedy answers
    answer = shared_answers(
        cache,
        greedy_answers(target, tok, device, vs.max_new_tokens, eos),
        {"max_new_tokens": vs.max_new_tokens, "eos": list(eos)},
    )
    prompts, rows, turns = expand_turns(prompts, rows, tok, answer, fit_set)
    fit = merge_fit(fit, turns["later_fit"])
    if len(turns["turns"]) > 1:
        fit["turns"] = turns["turns"]
    fit["context"] = context
    warm = _batches(rows[:1], tok.pad_token_id, 1)  # the set's first prompt, however batched
    if vs.batch_size > 1:
        prompts, rows = by_length(prompts, rows)
    texts = [p.text for p in prompts]
    batches = _batches(rows, tok.pad_token_id, vs.batch_size)
    return Setup(
        spec, target, drafter, tok, device, dtype, eos, texts, batches, warm, vs.engines, ready,
        prompt_fit=fit, buckets=[p.bucket for p in prompts], mapped=mapped,
        categories=category_labels(prompts, node_get(cfg.dataset, "label") or "dataset"),
        target_only=cache,
    )  # fmt: skip
