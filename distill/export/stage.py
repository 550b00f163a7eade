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
passes is renamed into `output_dir`, so the destination never holds half an export. The card
and export.json carry every engine's deployment lines (deploy.py); with `push_to_hub=ORG/NAME`
those lines name the hub repo and the published folder is uploaded there last (hub.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
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
from specdistill.data.stage_config import check_command_line
from specdistill.distill.export import check as export_check
from specdistill.distill.export import hub
from specdistill.distill.export import mapped as export_mapped
from specdistill.distill.export.align import (
    align_with_target,
    mark_parallel,
    resize_vocab_rows,
    target_generation,
)
from specdistill.distill.export.card import engine_settings, model_card
from specdistill.distill.export.deploy import Deployment, GGUFFiles, deployment
from specdistill.distill.export.gguf_files import check_gguf_export, served_file, write_ggufs
from specdistill.distill.export.head import pad_head_rows, write_token_map
from specdistill.distill.export.in_vllm import check_vllm_settings, validate_exported
from specdistill.distill.export.settings import ExportSettings

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
    # the K to serve with and each engine's flag for it (card.engine_settings)
    engine_settings: dict[str, Any] | None = None
    gguf: dict[str, Any] | None = None  # gguf.enabled: the GGUF files for llama.cpp (gguf_files.py)
    deployment: dict[str, Any] | None = None  # every engine's lines (deploy.py)
    hub: dict[str, Any] | None = None  # push_to_hub: the repo and what the export was made from


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


def resolve_sources(settings: ExportSettings, pair: Any) -> tuple[PairSpec, str]:
    """(pair, drafter to export): `drafter=PATH` or the pair's own drafter."""
    drafter = settings.drafter
    if drafter:
        p = Path(drafter).expanduser()
        if not (p / "config.json").exists():
            raise ConfigError(
                f"drafter={drafter!r} is not a saved checkpoint (no config.json): point it at a "
                "folder written by save_pretrained, e.g. the distill stage's best/"
            )
    spec = resolve_pair(pair, stage="export", mapped_ok=True)
    return spec, str(drafter or spec.drafter)


def _validated_context(report: dict[str, Any] | None) -> int | None:
    """The longest sequence the validate stage decoded: prompt cap + new tokens + a draft."""
    if not report:
        return None
    cap = (report.get("config") or {}).get("max_prompt_tokens")
    if not cap:
        return None
    return int(cap) + int(report["max_new_tokens"]) + int(report["gamma"]) + 1


@dataclass
class Prepared:
    """The drafter ready to be written, with the hooks where the two kinds of export differ: a
    drafter of the target's tokenizer (aligned to the target) and one with its own tokenizer
    (kept as is, served through the vocabulary intersection: export/mapped.py)."""

    model: Any
    tokenizer: Any  # written beside the weights
    # (one prompt's ids, the drafter's logits on them before any write): what the self-check
    # compares the written weights against
    reference: tuple[torch.Tensor, torch.Tensor]
    self_check: Callable[..., dict[str, Any]]  # (folder, **the check's common arguments)
    fields: dict[str, Any]  # this kind's ExportResult fields
    # (result, distill's result.json, the deployment lines, the license): README.md
    card: Callable[[ExportResult, dict[str, Any] | None, Deployment, str | None], str]
    vocab: str = "shared"  # deploy.VOCAB_KINDS: what the engines' lines are for
    drafting: str = "autoregressive"  # a parallel drafter: "parallel"
    # this kind's ExportResult fields that name the deployment (the mapped kind's vLLM config)
    deployed: Callable[[Deployment], dict[str, Any]] = lambda deploy: {}
    extra_files: Callable[[Path], object] = lambda folder: None
    kind: str = ""  # what the log line says of the kind


def _probe(
    model, tokenizer, text: str, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids of `text`, the model's logits on them over the first `rows` rows)."""
    probe = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        return probe, model(probe).logits[0, :, :rows].float()


def _drafter_revision(settings: ExportSettings, spec: PairSpec) -> str | None:
    """The pair's drafter revision applies to the pair's drafter, not to `drafter=PATH`."""
    return None if settings.drafter else spec.drafter_revision


def _load(settings: ExportSettings, spec: PairSpec, source: str):
    """The drafter's weights, in `dtype` (auto: its own)."""
    return load_model(
        source,
        revision=_drafter_revision(settings, spec),
        dtype=settings.weights_dtype or "auto",  # type: ignore[arg-type]
        trust_remote_code=spec.trust_remote_code,
        field=settings.drafter_field,
    )


def prepare_shared(
    settings: ExportSettings, spec: PairSpec, source: str, tok, report: dict[str, Any] | None
) -> Prepared:
    """A drafter of the target's tokenizer: rows padded or trimmed to the target's vocab_size,
    special ids and generation config the target's (module docstring)."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(
        spec.target, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    target_vocab = int(target_config.get_text_config().vocab_size)
    field_name = settings.drafter_field
    # The same tokenizer (not merely enough rows), before the drafter's weights load.
    check_drafter_tokenizer(
        tok,
        source,
        revision=_drafter_revision(settings, spec),
        target=spec.target,
        target_revision=spec.revision,
        trust_remote_code=spec.trust_remote_code,
        field_name=field_name,
    )
    model = _load(settings, spec, source)
    source_vocab = int(model.get_output_embeddings().weight.shape[0])
    try:
        check_vocab(target_vocab, source_vocab, len(tok))
    except ConfigError as e:
        raise ConfigError(f"{field_name}={source!r}: {e}") from e

    # Trained over its draft vocabulary: rows outside it set so they never win a greedy draft
    # (export/head.py), before the probe, so the check sees the head as exported.
    ids = getattr(model.config, "draft_vocab_ids", None)
    trained_sub = bool(((_distill_result(source) or {}).get("data") or {}).get("draft_vocab_train"))
    padded_rows = pad_head_rows(model, ids) if ids and trained_sub else 0
    # Reference logits on one prompt, to prove the row surgery left the real tokens alone.
    reference = _probe(model, tok, settings.check.prompts[0], len(tok))
    resize_vocab_rows(model, target_vocab)
    if padded_rows:  # rows the resize added (zero: logit 0 could win) get the centroid too
        padded_rows = pad_head_rows(model, ids)
    align_with_target(model, target_config, target_generation(spec, target_config))
    mask_id = mark_parallel(model, target_vocab, field_name, source)
    notes: list[str] = []
    if source_vocab != target_vocab:
        notes.append(f"vocabulary rows {source_vocab} -> {target_vocab} (the target's vocab_size)")
    return Prepared(
        model,
        tok,
        reference,
        self_check=lambda folder, **common: export_check.self_check(
            folder, spec, tok, expect_vocab=target_vocab, mask_token_id=mask_id, **common
        ),
        fields={
            "vocab_size": target_vocab,
            "source_vocab_size": source_vocab,
            "notes": notes,
            "draft_vocab": len(ids or ()),
            "padded_head_rows": padded_rows,
        },
        card=lambda result, distill, deploy, license: model_card(
            result, report, distill, deploy, license
        ),
        vocab="draft_vocab" if ids else "shared",
        drafting="autoregressive" if mask_id is None else "parallel",
        extra_files=lambda folder: write_token_map(folder, ids) if ids else None,
    )


def prepare_mapped(
    settings: ExportSettings, spec: PairSpec, source: str, tok, report: dict[str, Any] | None
) -> Prepared:
    """A drafter with its own tokenizer (export/mapped.py): its weights and tokenizer as they
    are, checked through `transformers` universal assisted generation and the TLI mapping."""
    from transformers import AutoTokenizer

    folder = export_mapped.drafter_tokenizer_folder(source, spec)
    draft_tok = AutoTokenizer.from_pretrained(str(folder))
    mapping = export_mapped.mapping_of(spec, folder)
    model = _load(settings, spec, source)
    rows = int(model.get_output_embeddings().weight.shape[0])
    k_source = engine_settings(report)["source"]
    return Prepared(
        model,
        draft_tok,
        _probe(model, draft_tok, settings.check.prompts[0]),
        self_check=lambda folder, **common: export_mapped.self_check(
            folder, spec, tok, draft_tok, **common
        ),
        fields={
            "vocab_size": rows,
            "source_vocab_size": rows,
            "notes": ["its own tokenizer: served through the vocabulary intersection (TLI)"],
        },
        card=lambda result, distill, deploy, license: export_mapped.mapped_card(
            result, distill, deploy, k_source, license
        ),
        vocab="mapped",
        deployed=lambda deploy: {
            "mapped": export_mapped.serving(deploy, mapping.intersection_size)
        },
        kind=" (its own tokenizer)",
    )


def check_report(settings: ExportSettings, source: str, report: dict[str, Any] | None) -> None:
    """The report given measured this drafter (its figures go on the card)."""
    if report and not _same_path(str(report["drafter"]), source):
        raise ConfigError(
            f"report={settings.report!r} measured drafter {report['drafter']!r}, not the "
            f"exported {source!r}: pass the validate report of this drafter (or none)"
        )


def run(cfg: DictConfig) -> ExportResult:
    """Export, self-check, publish, then upload when asked; see the module docstring. One path
    for both kinds of drafter: what differs (loading, row surgery, the check, the card) is
    `Prepared`'s."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    settings = ExportSettings.from_cfg(cfg)
    out, repo = settings.output_dir, settings.push_to_hub
    hub_record = None
    if repo:
        hub.check_token(repo)
        _, source = resolve_sources(settings, cfg.pair)
        inputs = hub.export_inputs(cfg, source, settings.report)
        saved = hub.published_export(out, repo, inputs, EXPORT_FILE)
        if saved is not None:  # a rerun after a failed upload: the upload only
            log.info("%s holds this export for %s already: uploading it only", out, repo)
            return _uploaded(ExportResult(**saved), repo, settings.hub_private)
        hub_record = {"repo_id": repo, "private": settings.hub_private, "inputs": inputs}
    check_destination(out, settings.overwrite)
    report = load_report(settings.report)
    use_vllm = check_vllm_settings(cfg)
    device = resolve_device(settings.check.device)
    check_dtype = parse_dtype(settings.check.dtype, device)
    spec, source = resolve_sources(settings, cfg.pair)
    check_report(settings, source, report)
    check_gguf_export(settings.gguf, spec.vocab, _local_config(source))
    engines = engine_settings(report)

    tok = AutoTokenizer.from_pretrained(
        spec.tokenizer, revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )
    prepare = prepare_mapped if spec.vocab == "mapped" else prepare_shared
    prepared = prepare(settings, spec, source, tok, report)
    model = prepared.model
    model.config.dtype = model.dtype
    mp = settings.min_positions
    needed = _validated_context(report) if mp == "auto" else int(mp)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with guard_write(out, param_bytes(model), cleanup=(tmp,)):
            model.save_pretrained(
                tmp, safe_serialization=True, max_shard_size=settings.max_shard_size
            )
            prepared.tokenizer.save_pretrained(tmp)
            prepared.extra_files(tmp)
            gguf_record = (
                write_ggufs(model, tmp, settings.gguf, spec.target, engines["k"])
                if settings.gguf.enabled
                else None
            )
        try:
            check = prepared.self_check(
                tmp,
                prompts=list(settings.check.prompts),
                max_new_tokens=settings.check.max_new_tokens,
                device=device,
                target_dtype=check_dtype,
                expect_dtype=model.dtype,
                min_positions=needed,
                reference_logits=prepared.reference[1],
                probe=prepared.reference[0],
            )
        except export_check.ExportCheckError as e:
            raise export_check.ExportCheckError(
                f"{e}; nothing was published ({out} is as it was)"
            ) from e
        # The folder about to be published, in the engine users deploy (both engines' report).
        vllm_figures = validate_exported(cfg, report, tmp) if use_vllm else None
        # Pushed, the lines name the hub repo instead of the local folder.
        deploy = deployment(
            spec.target,
            repo or str(out),
            engines["k"],
            drafting=prepared.drafting,
            vocab=prepared.vocab,
            gguf=GGUFFiles(gguf_record["target"], served_file(gguf_record))
            if gguf_record
            else None,
            drafter_on_hub=bool(repo),
        )
        if gguf_record:
            gguf_record["llama_server"] = deploy.llama_server
        result = ExportResult(
            output_dir=str(out),
            drafter=source,
            base_drafter=spec.drafter if settings.drafter else source,
            target=spec.target,
            dtype=str(model.dtype).removeprefix("torch."),
            parameters=sum(p.numel() for p in model.parameters()),
            files=[],
            check=check,
            report=settings.report if report else None,
            usage=deploy.transformers,
            vllm=vllm_figures,
            engine_settings=engines,
            gguf=gguf_record,
            deployment=to_jsonable(deploy),
            hub=hub_record,
            **prepared.fields,
            **prepared.deployed(deploy),
        )
        license = cfg.pair.get("license") if cfg.get("pair") else None
        (tmp / "README.md").write_text(
            prepared.card(result, _distill_result(source), deploy, license), encoding="utf-8"
        )
        result.files = [*sorted(p.name for p in tmp.iterdir()), EXPORT_FILE]
        result.wall_seconds = round(time.perf_counter() - t0, 1)
        (tmp / EXPORT_FILE).write_text(json.dumps(to_jsonable(result), indent=2) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s%s -> %s (%s)", source, prepared.kind, out, check)
    return _uploaded(result, repo, settings.hub_private) if repo else result


def _uploaded(result: ExportResult, repo: str, private: bool) -> ExportResult:
    """The published folder uploaded to `repo`; the commit's address added to the result
    (export.json keeps what was uploaded)."""
    address = hub.upload(Path(result.output_dir), repo, private)
    result.hub = {**(result.hub or {}), **address}
    return result


def _local_config(model: str) -> dict[str, Any]:
    """A local checkpoint's config.json (a hub id: {}; its weights load later)."""
    p = Path(model).expanduser() / "config.json"
    try:
        return read_json(p) if p.is_file() else {}
    except ValueError:
        return {}


def _distill_result(drafter: str) -> dict[str, Any] | None:
    """The distill stage's result.json when the drafter is its best/ or final/ folder."""
    p = Path(drafter).expanduser().parent / "result.json"
    try:
        return read_json(p) if p.is_file() else None
    except ValueError:
        return None


@hydra.main(config_path="pkg://specdistill.conf", config_name="export", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    """CLI: bad input is one `error:` line on stderr and exit status 2."""
    r = run_or_exit(run, cfg)
    print(f"exported {r.drafter} -> {r.output_dir} (vocab {r.vocab_size}, {r.dtype})")
    print(f"self-check: {OmegaConf.to_yaml(OmegaConf.create(r.check)).strip()}")
    print(f"use it: {r.usage}")
    if r.hub:
        print(f"uploaded to {r.hub['repo_id']}: {r.hub.get('commit_url') or r.hub.get('url')}")


def main() -> None:
    """`python -m specdistill.distill.export`: an unknown key on the command line is one
    `error:` line (exit 2) before Hydra composes the config, then Hydra's main runs it."""
    check_command_line("export")
    _hydra_main()


if __name__ == "__main__":
    main()
