"""`export push_to_hub=ORG/NAME` (distill/export/hub.py) against a fake HfApi: no network."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from specdistill.data.runtime import ConfigError
from specdistill.distill.export import hub
from specdistill.distill.export import stage as export
from tests.distill.test_export import _cfg

REPO = "my-org/toy-drafter"


class FakeHub:
    """Records the HfApi calls export makes; `fail` uploads raise (a network error)."""

    def __init__(self, fail: int = 0):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def api(self):
        fake = self

        class Api:
            def create_repo(self, repo_id, **kw):
                fake.calls.append(("create_repo", {"repo_id": repo_id, **kw}))
                return f"https://huggingface.co/{repo_id}"

            def upload_folder(self, **kw):
                files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
                fake.calls.append(("upload_folder", {**kw, "files": files}))
                if fake.fail:
                    fake.fail -= 1
                    raise ConnectionError("connection reset by peer")
                return type("Commit", (), {"commit_url": f"https://huggingface.co/{REPO}/c/1"})()

        return Api()


@pytest.fixture
def fake_hub(monkeypatch):
    fake = FakeHub()
    monkeypatch.setattr(hub, "HfApi", fake.api)
    monkeypatch.setattr(hub, "get_token", lambda: "hf_fake")
    return fake


def _refuse(*a, **k):
    raise AssertionError("the drafter was loaded")


def _front_matter(card: str) -> dict:
    head, _, _ = card.removeprefix("---\n").partition("\n---\n")
    return yaml.safe_load(head)


def _use_section(card: str) -> str:
    return card.split("## Use", 1)[1].split("\n## ", 1)[0]


def test_push_uploads_the_published_folder_and_the_card_names_hub_ids(tmp_path, toy_tiny, fake_hub):
    out = tmp_path / "drafter"
    res = export.run(_cfg(out, f"push_to_hub={REPO}", "+pair.license=apache-2.0"))
    names = [name for name, _ in fake_hub.calls]
    assert names == ["create_repo", "upload_folder"]
    create, upload = (kw for _, kw in fake_hub.calls)
    assert create["repo_id"] == REPO and create["private"] is True
    assert upload["repo_id"] == REPO and upload["folder_path"] == str(out)
    assert {"README.md", "export.json", "config.json", "model.safetensors"} <= set(upload["files"])
    assert res.hub["repo_id"] == REPO and res.hub["commit_url"].endswith("/c/1")
    card = (out / "README.md").read_text()
    use = _use_section(card)
    assert str(out) not in use  # the hub id, not the local folder
    serve = shlex.split(next(line for line in use.splitlines() if line.startswith("vllm serve")))
    assert json.loads(serve[serve.index("--speculative-config") + 1])["model"] == REPO
    sglang = shlex.split(next(line for line in use.splitlines() if "sglang" in line))
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == REPO
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}")' in use
    meta = _front_matter(card)
    assert meta["license"] == "apache-2.0" and meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == "transformers" and "draft-model" in meta["tags"]
    assert meta["specdistill"]["target"] == res.target
    assert "base_model" not in meta  # the toy drafter is a local folder, not a hub id
    saved = json.loads((out / "export.json").read_text())
    assert saved["hub"]["repo_id"] == REPO and saved["deployment"]["drafter"] == REPO
    assert saved["usage"] == res.usage and REPO in res.usage


def test_a_failed_upload_is_retried_alone_on_rerun(tmp_path, toy_tiny, monkeypatch):
    fake = FakeHub(fail=1)
    monkeypatch.setattr(hub, "HfApi", fake.api)
    monkeypatch.setattr(hub, "get_token", lambda: "hf_fake")
    out = tmp_path / "drafter"
    with pytest.raises(hub.HubUploadError, match=r"rerun the same command to retry the upload"):
        export.run(_cfg(out, f"push_to_hub={REPO}", "hub_private=false"))
    assert (out / "export.json").is_file()  # published before the upload
    first = (out / "README.md").read_text()
    # the rerun loads nothing (the pipeline's overwrite=true included): it uploads only
    monkeypatch.setattr(export, "load_model", _refuse)
    res = export.run(_cfg(out, f"push_to_hub={REPO}", "overwrite=true"))
    uploads = [kw for name, kw in fake.calls if name == "upload_folder"]
    assert len(uploads) == 2 and uploads[1]["folder_path"] == str(out)
    assert [kw["private"] for name, kw in fake.calls if name == "create_repo"] == [False, True]
    assert res.hub["commit_url"] and (out / "README.md").read_text() == first
    # another config is another export: not taken for this one
    with pytest.raises(ConfigError, match="output_dir=.*overwrite=true"):
        export.run(_cfg(out, f"push_to_hub={REPO}", "check.max_new_tokens=5"))


@pytest.mark.parametrize(
    "repo, words",
    [
        ("toy-drafter", "is not a hub repo id: write ORG/NAME"),
        ("a/b/c", "is not a hub repo id"),
        ("my-org/bad--name", "is not a valid hub repo id"),
        ("my-org/", "is not a hub repo id"),
    ],
)
def test_bad_repo_id_is_one_error_before_loading(tmp_path, monkeypatch, repo, words):
    monkeypatch.setattr(export, "load_model", _refuse)
    with pytest.raises(ConfigError, match=rf"^push_to_hub='{repo}' {words}") as e:
        export.run(_cfg(tmp_path / "out", f"push_to_hub={repo}"))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_no_token_is_one_error_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "get_token", lambda: None)
    monkeypatch.setattr(export, "load_model", _refuse)
    with pytest.raises(ConfigError, match=r"^push_to_hub='my-org/toy-drafter' needs .* HF_TOKEN"):
        export.run(_cfg(tmp_path / "out", f"push_to_hub={REPO}"))
    with pytest.raises(ConfigError, match=r"^hub_private='yes' must be true or false"):
        export.run(_cfg(tmp_path / "out", f"push_to_hub={REPO}", "hub_private=yes"))


def test_pipeline_plan_refuses_a_bad_repo_id_before_any_step(tmp_path):
    from specdistill.distill.pipeline.plan import build_plan
    from tests.distill.test_pipeline_plan import _cfg as pipeline_cfg

    with pytest.raises(ConfigError, match=r"^export\.push_to_hub='toy-drafter' is not a hub"):
        build_plan(pipeline_cfg(tmp_path, "++export.push_to_hub=toy-drafter"))
    steps = {s.name: s for s in build_plan(pipeline_cfg(tmp_path, f"++export.push_to_hub={REPO}"))}
    assert steps["export"].config["push_to_hub"] == REPO
    assert steps["export"].config["hub_private"] is True
