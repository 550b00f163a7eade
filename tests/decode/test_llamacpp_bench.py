"""The llama.cpp bench: its table, its argument checks, and (with a built llama-server) one
tiny end-to-end run on the toy pair with our decoder and the cost figures beside."""

from __future__ import annotations

import json

import pytest

from specdistill.data.runtime import ConfigError
from specdistill.decode.bench import llamacpp as bench


def _row(**kw):
    base = dict(
        drafter="d",
        k=3,
        p_min=0.0,
        temperature=0.0,
        acceptance=0.5,
        tau=2.0,
        tokens_per_s=40.0,
        plain_tokens_per_s=80.0,
        speedup=0.5,
        identical=True,
    )
    return bench.Row(**{**base, **kw})


def test_table_marks_what_was_not_measured():
    text = bench.table(
        [_row(ours_acceptance=0.45, ours_tau=1.9), _row(temperature=1.0, identical=None)]
    )
    lines = text.splitlines()
    assert lines[2] == "| d | 3 | 0 | 0 | 0.500 / 0.450 | 2.00 / 1.90 | 40.0 / 80.0 | 0.50x | yes |"
    assert lines[3].endswith("| 0.500 / - | 2.00 / - | 40.0 / 80.0 | 0.50x | - |")
    assert "NO" in bench.table([_row(identical=False)])


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="NAME=PATH.gguf"):
        bench._named("base")
    with pytest.raises(ConfigError, match="NAME=PATH.gguf"):
        bench._named(f"base={tmp_path / 'missing.gguf'}")
    with pytest.raises(ConfigError, match="--prompts='nope.jsonl'"):
        bench._prompt_ids(None, "nope.jsonl", 2)


@pytest.mark.llamacpp
def test_a_tiny_run_end_to_end(tmp_path, toy_tiny, capsys):
    from specdistill.decode.llamacpp.build import llama_server_binary
    from specdistill.distill.export import stage as export
    from tests.distill.test_export import _cfg

    try:
        llama_server_binary()
    except ConfigError as e:
        pytest.skip(f"no llama-server binary: {e}")
    record = export.run(_cfg(tmp_path / "d", "gguf.enabled=true", "gguf.types=[f16]")).gguf
    out = tmp_path / "bench.json"
    bench.main([
        "--target", record["target"], "--drafter", f"toy={tmp_path / 'd' / 'drafter-f16.gguf'}",
        "--num-prompts", "2", "--max-new-tokens", "12", "--k", "2", "--ours", "--ours-k", "2",
        "--costs", "--threads", "1", "--out", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["identical"] is True and 0 < row["tau"] <= 3
    assert row["ours_acceptance"] is not None and 1 <= row["ours_tau"] <= 3
    assert (
        set(result["costs"]["batch_cost"]) == {"1", "3"} and result["costs"]["drafter_c"]["toy"] > 0
    )
    assert "| toy | 2 | 0 | 0 |" in capsys.readouterr().out
