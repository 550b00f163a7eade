"""validate engines=[ours,llamacpp]: its settings, bad input before any weights load, the figures
from the servers' counters, ours on llama.cpp's footing, and (-m llamacpp, with a built
llama-server) the toy pair really served: greedy output with the drafter = plain output =
our target-only output, and llama.cpp's tau within noise of ours."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.llamacpp import files as llamacpp_files
from specdistill.decode.llamacpp.server import Completion, interleaved
from specdistill.decode.validate import setup as validate_setup
from specdistill.decode.validate import stage as validate
from specdistill.decode.validate.agreement import Acceptance, totals_agreement
from specdistill.decode.validate.engines import llamacpp as le
from specdistill.decode.validate.engines import parse_engines
from tests.conftest import main_in_process, stage_node

LLAMACPP = ("validate", "llamacpp")


def compose_validate(out: Path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="validate",
            overrides=["pair=toy-tiny", f"output_dir={out}", "step_time_iters=2", *overrides],
        )


# ---------------------------------------------------------------- settings and preflight


def test_engines_and_settings_are_checked(tmp_path):
    assert parse_engines({"engines": ["ours", "llamacpp"]}) == ("ours", "llamacpp")
    with pytest.raises(ConfigError, match=r"\[ours,llamacpp\]"):
        parse_engines({"engines": ["llamacpp"]})
    default = le.LlamaCppSettings.from_node(stage_node("validate", "llamacpp"))
    assert (default.drafter_type, default.threads, default.sampled_drafts) == (
        "target", None, "probabilistic")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^llamacpp\.target is missing"):
        le.LlamaCppSettings.from_node({})  # a node without a key: no second default fills it
    for node, field in (
        ({"drafter_type": "q3_k"}, "llamacpp.drafter_type='q3_k'"),
        ({"threads": 0}, "llamacpp.threads=0"),
        ({"p_min": 1.5}, "llamacpp.p_min=1.5"),
        ({"sampled_drafts": "top1"}, "llamacpp.sampled_drafts='top1'"),
        ({"target": str(tmp_path / "no.gguf")}, "llamacpp.target="),
        ({"drafter": str(tmp_path / "no.gguf")}, "llamacpp.drafter="),
    ):
        with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
            le.LlamaCppSettings.from_node(stage_node("validate", "llamacpp", **node))


def _no_binary(monkeypatch, tmp_path):
    from specdistill.decode.llamacpp import build

    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "no-build")
    monkeypatch.delenv("SPECDISTILL_LLAMA_SERVER", raising=False)


def test_a_missing_binary_is_one_error_line_before_any_weights_load(tmp_path, monkeypatch, capsys):
    _no_binary(monkeypatch, tmp_path)

    def no_loading(*a, **k):
        raise AssertionError("weights loaded before the llama.cpp check")

    monkeypatch.setattr(validate_setup, "load_pair", no_loading)
    argv = ["validate", "pair=toy-tiny", f"output_dir={tmp_path / 'v'}", "engines=[ours,llamacpp]"]
    code, err = main_in_process(validate.main, argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1
    line = err[0]
    assert line.startswith("error: engines=[ours,llamacpp]: llama-server is not built")
    assert "python -m specdistill.decode.llamacpp.build" in line


def test_what_llama_cpp_cannot_serve_is_refused_up_front(tmp_path, monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPECDISTILL_LLAMA_SERVER", str(fake))
    settings = le.LlamaCppSettings.from_node(stage_node("validate", "llamacpp"))
    with pytest.raises(ConfigError, match="no vocabulary mapping"):
        le.preflight(settings, SimpleNamespace(vocab="mapped", target="t", drafter="d"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"engines=\[ours,llamacpp\]: pair.target is 'gpt2'"):
        le.preflight(settings, SimpleNamespace(vocab="shared", target=str(gpt2), drafter=str(gpt2)))
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"engines=\[ours,llamacpp\]: the drafter is 'gpt2'"):
        le.preflight(
            settings, SimpleNamespace(vocab="shared", target=str(target), drafter=str(gpt2))
        )
    with pytest.raises(ConfigError, match="give its GGUF file as llamacpp.target"):
        le.preflight(settings, SimpleNamespace(vocab="shared", target="org/hub-id", drafter="d"))
    ok = SimpleNamespace(vocab="shared", target=str(target), drafter="org/hub-drafter")
    assert le.preflight(settings, ok) == fake


def test_a_draft_vocabulary_head_is_refused(toy_tiny_pair):
    _, drafter, _ = toy_tiny_pair
    small = SimpleNamespace(
        get_output_embeddings=lambda: SimpleNamespace(weight=torch.zeros(10, 4)),
        get_input_embeddings=drafter.get_input_embeddings,
    )
    with pytest.raises(ConfigError, match="draft-vocabulary checkpoint"):
        llamacpp_files.check_rows(small)
    llamacpp_files.check_rows(drafter)  # full head: fine


# ---------------------------------------------------------------- figures from counters


class FakeServer:
    """Answers like llama-server: `plan[i]` = (tokens, accepted, drafted) for prompt i."""

    def __init__(self, name: str, log: list, plan: dict[int, tuple[list[int], int, int]]):
        self.name, self.log, self.plan = name, log, plan

    def complete(self, ids, n, **kw):
        i = ids[0]
        self.log.append((self.name, i, kw["seed"], kw["temperature"]))
        tokens, acc, drafted = self.plan[i]
        return Completion(tokens, len(tokens), 100.0 if self.name == "plain" else 50.0, 0.0, 0,
                          0.0, draft_n=drafted, draft_n_accepted=acc)  # fmt: skip


def test_prompts_are_asked_of_both_servers_in_turn_and_counted():
    log: list = []
    plain = FakeServer("plain", log, {0: ([5, 6, 7, 8, 9], 0, 0), 1: ([1, 2, 3], 0, 0)})
    spec = FakeServer("spec", log, {0: ([5, 6, 7, 8, 9], 3, 6), 1: ([1, 2, 4], 1, 3)})
    s = Sampling(0.0)
    plains, specs = interleaved(plain, spec, [[0], [1]], s, 8, seed=7, repeats=2)
    assert [x[:3] for x in log[:4]] == [("plain", 0, 7), ("spec", 0, 7), ("plain", 1, 8),
                                        ("spec", 1, 8)]  # fmt: skip
    assert len(log) == 8 and len(plains) == len(specs) == 2
    row = le.mode_row(plains, specs, greedy=True)
    # rounds = predicted_n - 1 - accepted: (4 - 3) + (2 - 1) = 2; tau = (4 + 2) / 2
    assert (row["drafted"], row["accepted"], row["rounds"]) == (9, 4, 2)
    assert row["acceptance"] == pytest.approx(4 / 9, abs=1e-4) and row["tau"] == 3.0
    assert row["speedup"] == 2.0 and row["speedup_range"] == [2.0, 2.0]
    assert row["identical_to_plain"] is False and row["mismatched_sequences"] == 1
    assert le.mode_row(plains, specs, greedy=False)["identical_to_plain"] is None


def test_tau_agreement_against_brute_force():
    """z = (their mean L - our mean L) / (our per-round sd * sqrt(1/n + 1/m)), by hand."""
    rng = random.Random(3)
    lengths = [rng.randint(0, 3) for _ in range(300)]
    counts = tuple(sum(x >= j for x in lengths) for j in range(1, 4))
    ours = Acceptance.from_ours(counts, [300, 0, 0])
    mean = sum(lengths) / 300
    var = sum((x - mean) ** 2 for x in lengths) / 300

    def tau_agreement(accepted: int, rounds: int) -> dict:
        return totals_agreement(ours, accepted, rounds).as_dict("llamacpp", z_digits=2)

    a = tau_agreement(accepted=400, rounds=250)
    z = (400 / 250 - mean) / math.sqrt(var * (1 / 300 + 1 / 250))
    assert a["z"] == pytest.approx(z, abs=0.01) and a["beyond_noise"] == (abs(z) > 3)
    assert a["ours"] == pytest.approx(1 + mean, abs=1e-4) and a["llamacpp"] == 2.6
    near = tau_agreement(accepted=round(mean * 280), rounds=280)
    assert not near["beyond_noise"]
    assert tau_agreement(0, 0)["z"] is None


def test_ours_on_llama_cpp_footing_and_the_table():
    row = {"acceptance": 0.3, "tau": 1.9, "drafted": 90, "accepted": 27, "rounds": 30,
           "requests": 2, "plain_tokens_per_s": {"median": 50.0, "min": 49.0, "max": 51.0},
           "speculative_tokens_per_s": {"median": 25.0, "min": 24.0, "max": 26.0},
           "speedup": 0.5, "identical_to_plain": True, "plain_equals_ours_target_only": "2/2"}  # fmt: skip
    mine = {"accepted_at": [20, 8, 2], "trials_at": [30, 20, 8], "drafted": 90, "tau": 2.0,
            "alpha": 0.5, "speedup": 0.8}  # fmt: skip
    le.beside_ours(row, mine)
    assert row["ours"]["acceptance"] == pytest.approx(30 / 90, abs=1e-4)
    assert row["agreement"]["ours"] == 2.0 and row["agreement"]["llamacpp"] == 1.9
    le.beside_ours(other := {}, {"trials_at": []})
    assert other == {}
    report = {"version": "version: 0.6.0-dev (build 11434)", "k": 3, "p_min": 0.0, "threads": 2,
              "drafter": {"file": "/x/drafter-target.gguf", "written": True, "type": "target",
                          "bytes": 4.2e7}, "modes": {"greedy": row}}  # fmt: skip
    text = "\n".join(le.llamacpp_table(report))
    assert "llama.cpp (0.6.0-dev (build 11434); K=3" in text
    assert "| acceptance (accepted / drafted tokens), llama.cpp / ours | 0.3 / 0.3333 |" in text
    assert "| speedup over its own plain decoding, llama.cpp / ours | 0.5x / 0.8x |" in text
    assert "`drafter-target.gguf` (target, written here, 42.0 MB)" in text


def test_same_outputs_ignores_a_trailing_eos():
    from specdistill.decode.validate.agreement import same_outputs

    assert same_outputs([[1, 2, 0], [3]], [[1, 2], [4]], eos=(0,)) == "1/2"


# ---------------------------------------------------------------- for real (-m llamacpp)


@pytest.mark.llamacpp
def test_the_toy_pair_in_llama_cpp_beside_ours(tmp_path):
    from specdistill.decode.llamacpp.build import llama_server_binary

    try:
        llama_server_binary()
    except ConfigError as e:
        pytest.skip(f"no llama-server binary: {e}")
    out = tmp_path / "v"
    cfg = compose_validate(
        out, "engines=[ours,llamacpp]", "num_prompts=4", "max_new_tokens=24", "hf_assisted=false",
        "recommend_max_k=0", "llamacpp.drafter_type=f16", "llamacpp.threads=1", "progress=false",
    )  # fmt: skip
    r = validate.run(cfg)
    v = r.llamacpp
    assert v["drafter"]["written"] and Path(v["drafter"]["file"]).is_file()
    assert "build 11434" in v["version"] and v["k"] == r.gamma
    g = v["modes"]["greedy"]
    assert g["identical_to_plain"] is True and g["drafted"] > 0 and 1 <= g["tau"] <= r.gamma + 1
    assert g["plain_equals_ours_target_only"] == "4/4"
    assert not g["agreement"]["beyond_noise"], g["agreement"]
    assert set(v["modes"]) == {"greedy", "sampling"}
    assert v["modes"]["sampling"]["draft_sampling"] == "probabilistic"
    assert "## Two engines: our decoder and llama.cpp" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["llamacpp"]["k"] == r.gamma


def _section(acc: float, tau: float) -> dict:
    rate = {"median": 40.0, "min": 40.0, "max": 40.0}
    mode = {"acceptance": acc, "tau": tau, "speculative_tokens_per_s": rate,
            "plain_tokens_per_s": {"median": 80.0, "min": 80.0, "max": 80.0}, "speedup": 0.5,
            "identical_to_plain": True, "ours": {"acceptance": 0.4, "tau": 2.0, "speedup": 0.9}}  # fmt: skip
    return {"version": "version: b11434", "k": 3, "p_min": 0.0, "threads": 2,
            "drafter": {"file": "/d/drafter-target.gguf", "type": "target", "bytes": 4.3e7},
            "modes": {"greedy": mode}}  # fmt: skip


def test_summary_and_card_carry_llama_cpp_figures():
    from specdistill.distill.export.gguf_files import gguf_section
    from specdistill.distill.pipeline.llamacpp_report import llamacpp_lines

    stages = {"validate_base": {"llamacpp": _section(0.01, 1.03)},
              "validate": {"llamacpp": _section(0.34, 1.98)}}  # fmt: skip
    text = "\n".join(llamacpp_lines(stages))
    assert "In llama.cpp (b11434, `llama-server -md`, K=3" in text
    assert "| base | greedy | 0.01 / 0.4 | 1.03 / 2.0 | 40.0 / 80.0 | 0.5x / 0.9x | yes |" in text
    assert "| distilled | greedy | 0.34 / 0.4 | 1.98 / 2.0 |" in text
    assert llamacpp_lines({"validate": {"tau": 2.0}}) == []
    record = {"target": "/t.gguf", "k": 3, "files": {"target": {"file": "drafter-target.gguf",
              "file_type": "MOSTLY_Q4_1", "bytes": 4.3e7}}}  # fmt: skip
    card = "\n".join(gguf_section(record, _section(0.34, 1.98)))
    assert "| this drafter | greedy | 0.34 / 0.4 | 1.98 / 2.0 |" in card
    assert "| this drafter |" not in "\n".join(gguf_section(record))


def test_a_given_drafter_gguf_llama_cpp_would_refuse_is_refused_before_loading(
    tmp_path, monkeypatch, toy_tiny
):
    """llamacpp.drafter and a GGUF target: llama.cpp's pairing rule runs in the preflight."""
    pytest.importorskip("gguf")
    from tests.data.gguf_models import tiny_bpe, tiny_llama, write_llama_gguf

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPECDISTILL_LLAMA_SERVER", str(fake))
    from transformers import AutoTokenizer

    small = tiny_bpe(320)
    toy = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))  # other texts, other size
    target = write_llama_gguf(tmp_path / "t.gguf", tiny_llama(len(small)), small)
    other = write_llama_gguf(tmp_path / "d.gguf", tiny_llama(len(toy)), toy)
    same = write_llama_gguf(tmp_path / "s.gguf", tiny_llama(len(small), layers=1), small)
    spec = SimpleNamespace(vocab="shared", target=str(target), drafter="org/any")
    with pytest.raises(ConfigError, match=r"llama.cpp would refuse d.gguf as a drafter of t.gguf"):
        le.preflight(le.LlamaCppSettings.from_node(stage_node(*LLAMACPP, drafter=str(other))), spec)
    assert (
        le.preflight(le.LlamaCppSettings.from_node(stage_node(*LLAMACPP, drafter=str(same))), spec)
        == fake
    )


def test_llama_cpp_figures_by_benchmark_category():
    def c(n, acc, drafted, ms):
        return Completion(list(range(n)), n, ms, 0.0, 0, 0.0, draft_n=drafted, draft_n_accepted=acc)

    keys = [("mt_bench", "writing"), ("mt_bench", "math"), ("gsm8k", "all")]
    plains = [[c(9, 0, 0, 80.0), c(9, 0, 0, 80.0), c(5, 0, 0, 40.0)]]
    specs = [[c(9, 4, 6, 40.0), c(9, 0, 8, 160.0), c(5, 2, 3, 20.0)]]
    rows = {(r["set"], r["category"]): r for r in le.category_rows(keys, plains, specs)}
    assert list(rows) == [("mt_bench", "writing"), ("mt_bench", "math"), ("mt_bench", "all"),
                          ("gsm8k", "all"), ("all", "all")]  # fmt: skip
    w = rows[("mt_bench", "writing")]  # 8 decode tokens, 4 accepted: 4 rounds
    assert (w["tau"], w["acceptance"], w["speedup"], w["requests"]) == (
        2.0,
        round(4 / 6, 4),
        2.0,
        1,
    )
    assert rows[("mt_bench", "math")]["tau"] == 1.0 and rows[("mt_bench", "math")]["speedup"] == 0.5
    both = rows[("all", "all")]  # (8 + 8 + 4) decode tokens over (4 + 8 + 2) rounds
    assert both["tau"] == round(20 / 14, 3) and both["requests"] == 3
    section = _section(0.3, 2.0)
    section["modes"]["greedy"]["categories"] = list(rows.values())
    text = "\n".join(le.llamacpp_table(section | {"modes": {"greedy": {
        **section["modes"]["greedy"], "drafted": 17, "accepted": 6, "rounds": 14,
        "identical_to_plain": True}}}))  # fmt: skip
    assert "| mt_bench | writing | 1 | 2.0, 0.6667, 2.0x |" in text
