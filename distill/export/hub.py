"""`push_to_hub=ORG/NAME`: the published export folder uploaded to the Hugging Face Hub.

The upload runs last: after the drafter, its card and export.json are written, self-checked and
published into `output_dir`, so the hub only ever receives a folder that passed. The card then
names the hub ids (ORG/NAME for the drafter) instead of local paths. A private repository by
default (`hub_private`); the token is huggingface_hub's usual one (HF_TOKEN, or `hf auth login`).

Resumable: export.json records the repo id and a fingerprint of what the export was made from
(the stage's config, the drafter's files, the report). A rerun that finds the same export for the
same repo in `output_dir` uploads that folder again and redoes nothing else; upload_folder sends
only the files the hub lacks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from omegaconf import OmegaConf

from specdistill.data.io import read_json
from specdistill.data.runtime import ConfigError

log = logging.getLogger("specdistill.export")


class HubUploadError(ConfigError):
    """The upload failed after the export was published: the message says how to retry."""


def check_repo_id(value: Any) -> str | None:
    """`push_to_hub` checked before any weights load: None, or an ORG/NAME hub repo id."""
    if value is None or value == "":
        return None
    text = str(value)
    fix = "write ORG/NAME (a user or organisation, a slash, the model's name), or null"
    if text.count("/") != 1 or not all(text.split("/")):
        raise ConfigError(f"push_to_hub={text!r} is not a hub repo id: {fix}")
    try:
        validate_repo_id(text)
    except HFValidationError as e:
        raise ConfigError(f"push_to_hub={text!r} is not a valid hub repo id ({e}): {fix}") from e
    return text


def check_token(repo_id: str) -> None:
    """A token to upload with, found before any weights load (not checked against the hub)."""
    if not get_token():
        raise ConfigError(
            f"push_to_hub={repo_id!r} needs a Hugging Face token with write access: set HF_TOKEN "
            "or run `hf auth login`"
        )


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub model id (ORG/NAME) rather than a local path."""
    if not name or Path(name).expanduser().exists() or name.startswith(("/", ".", "~")):
        return False
    try:
        return check_repo_id(name) is not None
    except ConfigError:
        return False


def export_inputs(cfg: Any, source: str, report: str | None) -> str:
    """A fingerprint of what an export is made from: the stage's config (all but the keys that
    change nothing in the folder: `overwrite`, `hub_private`), the drafter folder's files and the
    report file (name, size, modification time)."""
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    for key in ("overwrite", "hub_private"):
        config.pop(key, None)  # type: ignore[union-attr]
    files = []
    for root in (source, report):
        p = Path(root).expanduser() if root else None
        if p is None or not p.exists():
            files.append(str(root))
            continue
        for f in sorted([p] if p.is_file() else p.rglob("*")):
            if f.is_file():
                st = f.stat()
                files.append([str(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"config": config, "files": files}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def published_export(out: Path, repo_id: str, inputs: str, record: str) -> dict[str, Any] | None:
    """export.json of the export already in `out` when it is this one for this repo (a rerun
    after a failed upload), else None."""
    path = out / record
    try:
        saved = read_json(path) if path.is_file() else None
    except ValueError:
        return None
    hub = (saved or {}).get("hub") or {}
    if hub.get("repo_id") == repo_id and hub.get("inputs") == inputs:
        return saved
    return None


def upload(folder: Path, repo_id: str, private: bool) -> dict[str, Any]:
    """Create the repo (private unless told otherwise; kept as it is when it exists) and upload
    `folder`; returns the commit's address. A failure is one line saying how to retry."""
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message="Upload a specdistill drafter export",
        )
    except Exception as e:  # network, auth, quota: the export itself is published and kept
        raise HubUploadError(
            f"push_to_hub={repo_id!r}: the upload failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no message'}); the export is published in "
            f"{str(folder)!r}: rerun the same command to retry the upload only"
        ) from e
    log.info("uploaded %s -> %s", folder, getattr(commit, "commit_url", url))
    return {"url": str(url), "commit_url": getattr(commit, "commit_url", None)}
