"""The export stage: the aligned drafter q as a checkpoint a serving stack loads as is.

    python -m specdistill.distill.export pair=toy-tiny output_dir=DIR
    python -m specdistill.distill.export pair=llama3 drafter=RUN/distill/best \
        report=RUN/validate/report.json output_dir=DIR dtype=bf16

Serving engines pair a drafter with a target (p) only when the two agree on the vocabulary
size, the special token ids and the tokenizer, so the export makes them agree: the drafter's
embedding and LM-head rows are padded (zero rows) or trimmed to the target's `vocab_size`
(tied weights stay tied), bos/eos/pad ids and `generation_config.json` are the target's, and the
target's tokenizer files and chat template are written beside the weights, with a model card.

Everything is written to a temporary sibling folder and checked there (reload, tokenizer,
`generate(assistant_model=...)` reproduces the target's greedy output); only a checkpoint that
passes is renamed into `output_dir`, so the destination never holds half an export.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.data.io import guard_write, param_bytes, read_json, replace_dir, to_jsonable
from specdistill.data.models.pairs import (
    PairSpec,
    check_vocab,
    load_model,
    resolve_pair,
)
from specdistill.data.models.tokenizer_identity import check_drafter_tokenizer
from specdistill.data.runtime import ConfigError, parse_dtype, resolve_device, run_or_exit
from specdistill.distill.export import check as export_check
from specdistill.distill.export import mapped as export_mapped
from specdistill.distill.export.card import model_card, usage_command
from specdistill.distill.export.head import pad_head_rows, write_token_map
from specdistill.distill.export.in_vllm import check_vllm_settings, validate_exported

log = logging.getLogger("specdistill.export")

EXPORT_FILE = "export.json"


@dataclass
class ExportResult:
    """What export.json records: where the drafter came from and what the self-check found."""

    output_dir: str
    drafter: str
    base_drafter: str
    target: str
    vocab_size: int
    source_vocab_size: int
    dtype: str
    parameters: int
    files: list[str]
    check: dict[str, Any]
    report: str | None
    usage: str
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    vllm: dict[str, Any] | None = None  # vllm.enabled: the folder validated in vLLM (in_vllm.py)
    draft_vocab: int = 0  # config.json draft_vocab_ids: tokens our decoder's head scores (0: all)
    padded_head_rows: int = 0  # rows outside a trained-over draft vocabulary set to never win
    mapped: dict[str, Any] | None = None  # its own tokenizer: how to serve it (export/mapped.py)


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse to replace a folder (or file) with other content unless overwrite=true."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not overwrite):
        raise ConfigError(
            f"output_dir={str(out)!r} exists with other content: choose an empty or new folder, "
            "or set overwrite=true to replace it"
        )


def load_report(path: str | None) -> dict[str, Any] | None:
    """A validate report.json (or the folder holding one), checked before any model loads."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise ConfigError(f"report={path!r}: no validate report.json there; run the validate stage")
    try:
        report = read_json(p)
    except ValueError as e:
        raise ConfigError(f"report={path!r} is not valid JSON: {e}") from e
    missing = [k for k in ("alpha", "tau", "gamma", "speedup", "drafter") if k not in report]
    if missing:
        raise ConfigError(f"report={path!r} lacks {missing}: point it at a validate report.json")
    return report


def _same_path(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def resolve_sources(cfg: DictConfig) -> tuple[PairSpec, str]:
    """(pair, drafter to export): `drafter=PATH` or the pair's own drafter."""
    drafter = cfg.get("drafter")
    if drafter:
        p = Path(str(drafter)).expanduser()
        if not (p / "config.json").exists():
            raise ConfigError(
                f"drafter={drafter!r} is not a saved checkpoint (no config.json): point it at a "
                "folder written by save_pretrained, e.g. the distill stage's best/"
            )
    spec = resolve_pair(cfg.pair, stage="export", mapped_ok=True)
    return spec, str(drafter or spec.drafter)


def resize_vocab_rows(model, size: int) -> int:
    """Pad (zero rows) or trim the embedding and LM-head rows to `size`; returns the old size.

    Rows past the tokenizer's length are padding: no text maps to them. New rows are zero, so
    their logit is exactly 0 and every real token's logit is unchanged. Tied weights stay one
    tensor (resize_token_embeddings re-ties them).
    """
    old = int(model.get_input_embeddings().weight.shape[0])
    head_old = int(model.get_output_embeddings().weight.shape[0])
    if old == size and head_old == size:
        return old
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        if size > old:
            emb[old:].zero_()
        head = model.get_output_embeddings()
        if head.weight.data_ptr() != emb.data_ptr() and size > head_old:
            head.weight[head_old:].zero_()
            if getattr(head, "bias", None) is not None:
                head.bias[head_old:].zero_()
    model.config.vocab_size = size
    return old


def align_with_target(model, target_config, target_generation) -> None:
    """bos/eos/pad ids and the generation config become the target's."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(target_config, key, None))
    model.generation_config = target_generation


def mark_parallel(model, vocab: int, field_name: str, source: str) -> int | None:
    """A parallel (PARD) drafter's mask token, written where serving engines look for it:
    `mask_token_id` (ours; TensorRT-LLM's PARDDecodingConfig takes it), `pard_token` (what
    vLLM's draft_model method reads for `parallel_drafting`) and `parallel_drafting`. None for
    an autoregressive drafter (its config has no mask_token_id)."""
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        return None
    if not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
        raise ConfigError(
            f"{field_name}={source!r}: config.json mask_token_id={mask_id!r} is not a token id "
            f"of the target's vocabulary (0..{vocab - 1})"
        )
    info = dict(getattr(model.config, "parallel_drafting", None) or {})
    model.config.pard_token = mask_id
    model.config.parallel_drafting = info | {"mask_token_id": mask_id}
    return mask_id


def _target_generation(spec: PairSpec, target_config):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(spec.target, revision=spec.revision)
    except OSError:
        return GenerationConfig.from_model_config(target_config)


def _validated_context(report: dict[str, Any] | None) -> int | None:
    """The longest sequence the validate stage decoded: prompt cap + new tokens + a draft."""
    if not report:
        return None
    cap = (report.get("config") or {}).get("max_prompt_tokens")
    if not cap:
        return None
    return int(cap) + int(report["max_new_tokens"]) + int(report["gamma"]) + 1


def run(cfg: DictConfig) -> ExportResult:
    """Export, self-check, publish; see the module docstring."""
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.perf_counter()
    out = Path(str(cfg.output_dir)).expanduser().absolute()
    overwrite = bool(cfg.get("overwrite", False))
    check_destination(out, overwrite)
    report = load_report(cfg.get("report"))
    use_vllm = check_vllm_settings(cfg)
    raw_dtype = str(cfg.get("dtype", "auto"))
    dtype = None if raw_dtype == "auto" else parse_dtype(raw_dtype, "cpu")
    min_pos = cfg.get("min_positions", "auto")
    if min_pos != "auto" and (not isinstance(min_pos, int) or min_pos < 1):
        raise ConfigError(f"min_positions={min_pos!r} must be auto or a positive integer")
    prompts = list(cfg.check.prompts or [])
    if not prompts:
        raise ConfigError("check.prompts is empty: the self-check needs at least one prompt")
    device = resolve_device(str(cfg.check.get("device", "auto")))
    check_dtype = parse_dtype(str(cfg.check.get("dtype", "fp32")), device)
    spec, source = resolve_sources(cfg)
    if report and not _same_path(str(report["drafter"]), source):
        raise ConfigError(
            f"report={cfg.report!r} measured drafter {report['drafter']!r}, not the exported "
            f"{source!r}: pass the validate report of this drafter (or none)"
        )

    tok = AutoTokenizer.from_pretrained(
        spec.tokenizer, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    if spec.vocab == "mapped":
        return _run_mapped(cfg, spec, source, tok, report, prompts, device, check_dtype, t0)
    target_config = AutoConfig.from_pretrained(
        spec.target, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    target_vocab = int(target_config.get_text_config().vocab_size)
    drafter_rev = None if cfg.get("drafter") else spec.drafter_revision
    field_name = "drafter" if cfg.get("drafter") else "pair.drafter"
    # The same tokenizer (not merely enough rows), before the drafter's weights load.
    check_drafter_tokenizer(
        tok,
        source,
        revision=drafter_rev,
        target=spec.target,
        target_revision=spec.revision,
        trust_remote_code=spec.trust_remote_code,
        field_name=field_name,
    )
    model = load_model(
        source,
        revision=drafter_rev,
        dtype=dtype or "auto",  # type: ignore[arg-type]
        trust_remote_code=spec.trust_remote_code,
        field=field_name,
    )
    source_vocab = int(model.get_output_embeddings().weight.shape[0])
    try:
        check_vocab(target_vocab, source_vocab, len(tok))
    except ConfigError as e:
        raise ConfigError(f"{field_name}={source!r}: {e}") from e

    # Trained over its draft vocabulary: rows outside it set so they never win a greedy draft
    # (export/head.py), before the probe, so the check below sees the head as exported.
    ids = getattr(model.config, "draft_vocab_ids", None)
    trained_sub = bool(((_distill_result(source) or {}).get("data") or {}).get("draft_vocab_train"))
    padded_rows = pad_head_rows(model, ids) if ids and trained_sub else 0
    # Reference logits on one prompt, to prove the row surgery left the real tokens alone.
    probe = torch.tensor([tok(prompts[0], add_special_tokens=False).input_ids])
    with torch.no_grad():
        before = model(probe).logits[0, :, : len(tok)].float()
    resize_vocab_rows(model, target_vocab)
    if padded_rows:  # rows the resize added (zero: logit 0 could win) get the centroid too
        padded_rows = pad_head_rows(model, ids)
    align_with_target(model, target_config, _target_generation(spec, target_config))
    mask_id = mark_parallel(model, target_vocab, field_name, source)
    model.config.dtype = model.dtype
    notes: list[str] = []
    if source_vocab != target_vocab:
        notes.append(f"vocabulary rows {source_vocab} -> {target_vocab} (the target's vocab_size)")

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with guard_write(out, param_bytes(model), cleanup=(tmp,)):
            model.save_pretrained(
                tmp, safe_serialization=True, max_shard_size=str(cfg.max_shard_size)
            )
            tok.save_pretrained(tmp)
            if ids:
                write_token_map(tmp, ids)
        needed = _validated_context(report) if min_pos == "auto" else int(min_pos)
        check = export_check.self_check(
            tmp,
            spec,
            tok,
            prompts=prompts,
            max_new_tokens=int(cfg.check.max_new_tokens),
            device=device,
            target_dtype=check_dtype,
            expect_dtype=model.dtype,
            expect_vocab=target_vocab,
            min_positions=needed,
            reference_logits=before,
            probe=probe,
            mask_token_id=mask_id,
        )
        base = spec.drafter if cfg.get("drafter") else source
        # The folder about to be published, in the engine users deploy (both engines' report).
        vllm_figures = validate_exported(cfg, report, tmp) if use_vllm else None
        result = ExportResult(
            output_dir=str(out),
            drafter=source,
            base_drafter=base,
            target=spec.target,
            vocab_size=target_vocab,
            source_vocab_size=source_vocab,
            dtype=str(model.dtype).removeprefix("torch."),
            parameters=sum(p.numel() for p in model.parameters()),
            files=[],
            check=check,
            report=str(cfg.report) if report else None,
            usage=usage_command(str(out), spec.target, report),
            notes=notes,
            vllm=vllm_figures,
            draft_vocab=len(getattr(model.config, "draft_vocab_ids", None) or ()),
            padded_head_rows=padded_rows,
        )
        distill = _distill_result(source)
        (tmp / "README.md").write_text(model_card(result, report, distill), encoding="utf-8")
        result.files = [*sorted(p.name for p in tmp.iterdir()), EXPORT_FILE]
        result.wall_seconds = round(time.perf_counter() - t0, 1)
        (tmp / EXPORT_FILE).write_text(json.dumps(to_jsonable(result), indent=2) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s -> %s (%s)", source, out, check)
    return result


def _run_mapped(
    cfg: DictConfig, spec: PairSpec, source: str, tok, report: dict[str, Any] | None,
    prompts: list[str], device: torch.device, check_dtype: torch.dtype, t0: float,
) -> ExportResult:  # fmt: skip
    """A drafter with its own tokenizer (export/mapped.py): its weights and tokenizer as they
    are, checked through `transformers` universal assisted generation and the TLI mapping."""
    from transformers import AutoTokenizer

    out = Path(str(cfg.output_dir)).expanduser().absolute()
    folder = export_mapped.drafter_tokenizer_folder(source, spec)
    draft_tok = AutoTokenizer.from_pretrained(str(folder))
    mapping = export_mapped.mapping_of(spec, folder)
    raw_dtype = str(cfg.get("dtype", "auto"))
    dtype = None if raw_dtype == "auto" else parse_dtype(raw_dtype, "cpu")
    field_name = "drafter" if cfg.get("drafter") else "pair.drafter"
    drafter_rev = None if cfg.get("drafter") else spec.drafter_revision
    model = export_mapped.load_drafter(
        source, field_name, drafter_rev, dtype, spec.trust_remote_code
    )
    rows = int(model.get_output_embeddings().weight.shape[0])
    probe = torch.tensor([draft_tok(prompts[0], add_special_tokens=False).input_ids])
    with torch.no_grad():
        before = model(probe).logits[0].float()
    model.config.dtype = model.dtype
    min_pos = cfg.get("min_positions", "auto")
    needed = _validated_context(report) if min_pos == "auto" else int(min_pos)
    gamma = int(report["gamma"]) if report else 4
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with guard_write(out, param_bytes(model), cleanup=(tmp,)):
            model.save_pretrained(
                tmp, safe_serialization=True, max_shard_size=str(cfg.max_shard_size)
            )
            draft_tok.save_pretrained(tmp)
        check = export_mapped.self_check(
            tmp, spec, tok, draft_tok, prompts=prompts,
            max_new_tokens=int(cfg.check.max_new_tokens), device=device,
            target_dtype=check_dtype, expect_dtype=model.dtype, min_positions=needed,
            reference_logits=before, probe=probe,
        )  # fmt: skip
        # vllm.enabled: the folder about to be published, in vLLM as TLI (use_heterogeneous_vocab).
        vllm_figures = validate_exported(cfg, report, tmp) if cfg.vllm.enabled else None
        result = ExportResult(
            output_dir=str(out),
            drafter=source,
            base_drafter=spec.drafter if cfg.get("drafter") else source,
            target=spec.target,
            vocab_size=rows,
            source_vocab_size=rows,
            dtype=str(model.dtype).removeprefix("torch."),
            parameters=sum(p.numel() for p in model.parameters()),
            files=[],
            check=check,
            report=str(cfg.report) if report else None,
            usage=export_mapped.usage_command(str(out), spec.target),
            notes=["its own tokenizer: served through the vocabulary intersection (TLI)"],
            mapped=export_mapped.serving(str(out), spec.target, gamma, mapping.intersection_size),
            vllm=vllm_figures,
        )
        card = export_mapped.mapped_card(result, _distill_result(source), gamma)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        result.files = [*sorted(p.name for p in tmp.iterdir()), EXPORT_FILE]
        result.wall_seconds = round(time.perf_counter() - t0, 1)
        (tmp / EXPORT_FILE).write_text(json.dumps(to_jsonable(result), indent=2) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s (its own tokenizer) -> %s (%s)", source, out, check)
    return result


def _distill_result(drafter: str) -> dict[str, Any] | None:
    """The distill stage's result.json when the drafter is its best/ or final/ folder."""
    p = Path(drafter).expanduser().parent / "result.json"
    try:
        return read_json(p) if p.is_file() else None
    except ValueError:
        return None


@hydra.main(config_path="pkg://specdistill.conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """CLI: bad input is one `error:` line on stderr and exit status 2."""
    r = run_or_exit(run, cfg)
    print(f"exported {r.drafter} -> {r.output_dir} (vocab {r.vocab_size}, {r.dtype})")
    print(f"self-check: {OmegaConf.to_yaml(OmegaConf.create(r.check)).strip()}")
    print(f"use it: {r.usage}")


if __name__ == "__main__":
    main()
