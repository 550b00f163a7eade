"""The engine protocol (decode/validate/engines/): every engine has the same entry points, the
stage runs ours first and vLLM last, each engine's caveats about our decode are one rule, and an
engine runs through the stage on validate's own prompts (llama-server faked: its answers are
fixed functions of the prompt), its figures beside ours."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from hydra import compose, initialize_config_module

from specdistill.decode.config import DecoderSettings
from specdistill.decode.llamacpp import server
from specdistill.decode.llamacpp.server import Completion
from specdistill.decode.validate import stage as validate
from specdistill.decode.validate.engines import ENGINES, SELECTABLE, chosen, run_order
from specdistill.decode.validate.engines import llamacpp as le
from specdistill.decode.validate.engines import vllm as ve
from specdistill.decode.validate.engines.base import Ours, ReportPart, caveats

ENTRY_POINTS = ("settings", "preflight", "run", "report", "summary_lines")


def test_every_engine_has_the_one_shape():
    assert list(ENGINES) == ["ours", "hf_assisted", "vllm", "llamacpp"]
    assert set(SELECTABLE) <= set(ENGINES)
    for name, engine in ENGINES.items():
        assert engine.name == name and isinstance(engine.runs_last, bool)
        assert all(callable(getattr(engine, f, None)) for f in ENTRY_POINTS), name
        if name != "ours":  # nothing of an engine that did not run
            assert engine.report({name: None}) == ReportPart([], [])
            assert engine.summary_lines([]) == []


def test_ours_runs_first_and_vllm_last():
    order = [e.name for e in run_order(chosen(("ours", "vllm", "llamacpp"), True))]
    assert order == ["ours", "hf_assisted", "llamacpp", "vllm"]
    assert [e.name for e in chosen(("ours",), False)] == ["ours"]


def test_each_way_our_decode_differs_is_one_note_in_one_order():
    plain = Ours(DecoderSettings(), False, 4, {}, 1.0, None)
    assert caveats(plain, le.CAVEATS) == caveats(plain, ve.CAVEATS) == []
    odd = DecoderSettings(draft_length="heuristic", lenience=0.5, lookup=True)
    notes = caveats(Ours(odd, True, 3, {}, 1.0, None), le.CAVEATS)
    assert notes == [
        "llama.cpp drafts up to a fixed K=3; ours used draft_length=heuristic",
        "llama.cpp verifies losslessly; ours used a lossy lenience: acceptance differs",
        "llama.cpp drafts with the drafter alone; ours also by prompt lookup",
        "llama.cpp runs the parallel drafter autoregressively (one token a forward)",
    ]
    assert len(caveats(Ours(odd, True, 3, {}, 1.0, None), ve.CAVEATS)) == 2  # vLLM: two apply


class FakeServer:
    """llama-server's answers as fixed functions of the prompt: the plain server echoes the
    prompt's last token, the speculative one too but for prompts of odd length (its last token
    differs), drafting 3 tokens a round and accepting 2."""

    # (with the drafter, temperature, new tokens, prompt length) of every request
    asked: ClassVar[list[tuple[bool, float, int, int]]] = []

    def __init__(self, binary, target, draft=None, **kw):
        self.draft = draft

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def complete(self, ids, n, temperature=0.0, seed=0, top_k=0, top_p=1.0):
        FakeServer.asked.append((self.draft is not None, temperature, n, len(ids)))
        tokens = [ids[-1]] * n
        if self.draft is None:
            return Completion(tokens, n, 10.0 * n, 0.0, len(ids), 1.0)
        if len(ids) % 2:
            tokens[-1] += 1
        rounds = (n - 1) // 3
        return Completion(tokens, n, 5.0 * n, 0.0, len(ids), 1.0, draft_n=3 * rounds,
                          draft_n_accepted=2 * rounds)  # fmt: skip


def test_an_engine_runs_through_the_stage_beside_ours(toy_tiny, tmp_path, monkeypatch, one_thread):
    drafter = (tmp_path / "drafter-target.gguf", {"file": str(tmp_path / "drafter-target.gguf"),
               "written": True, "type": "target", "bytes": 2.0e6, "file_type": "MOSTLY_F16"})  # fmt: skip
    monkeypatch.setattr(le, "preflight", lambda settings, spec: tmp_path / "llama-server")
    monkeypatch.setattr(le, "drafter_gguf", lambda *a: drafter)
    monkeypatch.setattr(server, "LlamaServer", FakeServer)
    monkeypatch.setattr(server, "version", lambda binary: "version: 0.0.1 (build 11434)")
    monkeypatch.setattr("specdistill.data.models.target_gguf.target_gguf", lambda t: tmp_path)
    FakeServer.asked = []
    out = tmp_path / "v"
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="validate", overrides=[
            "pair=toy-tiny", f"output_dir={out}", "step_time_iters=2", "num_prompts=3",
            "max_new_tokens=8", "engines=[ours,llamacpp]", "hf_assisted=false",
            "recommend_max_k=0", "progress=false", "plot=false", "decoder.draft_length=heuristic",
        ])  # fmt: skip
    r = validate.run(cfg)
    v = r.llamacpp
    assert set(v["modes"]) == set(r.modes) == {"greedy", "sampling"}
    # every prompt asked of both servers in turn, once a mode, after one warm-up each
    assert len(FakeServer.asked) == 2 * (2 + 2 * 3)
    for mode, row in v["modes"].items():
        mine = r.modes[mode]
        assert row["ours"]["tau"] == mine["tau"] and row["ours"]["alpha"] == mine["alpha"]
        assert row["ours"]["acceptance"] == pytest.approx(
            sum(mine["accepted_at"]) / mine["drafted"], abs=1e-4
        )
        assert (row["drafted"], row["accepted"]) == (3 * 2 * 3, 2 * 2 * 3)  # 2 rounds a prompt
        assert row["agreement"]["ours"] == pytest.approx(1 + sum(mine["accepted_at"])
                                                         / mine["trials_at"][0], abs=1e-4)  # fmt: skip
    g = v["modes"]["greedy"]
    odd = sum(length % 2 for d, t, n, length in FakeServer.asked if d and t == 0 and n == 8)
    assert 0 < odd < 3  # the toy prompts: both kinds, so both branches are checked
    assert g["mismatched_sequences"] == odd and g["identical_to_plain"] is (odd == 0)
    assert g["plain_equals_ours_target_only"].endswith("/3")
    notes = r.notes
    assert "llama.cpp drafts up to a fixed K=4; ours used draft_length=heuristic" in notes
    assert any(n.startswith("llama.cpp greedy with the drafter differs") for n in notes) == (
        odd > 0
    )
    text = (out / "report.md").read_text()
    assert "## Two engines: our decoder and llama.cpp (0.0.1 (build 11434); K=4" in text
    assert json.loads((out / "report.json").read_text())["llamacpp"]["k"] == 4
