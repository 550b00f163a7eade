"""The generate stage on toy-tiny: lossless batching, resume, shards, merge, CLI, top-k log-probs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import datasets
import pytest
import torch

from specdistill.data.generate import batched, fitted_prompts
from specdistill.data.generate import stage as gen
from specdistill.data.generate.settings import GenerateSettings
from specdistill.data.generate.shard_processes import local_processes, usable_cores
from specdistill.data.generate.storage import F16_RELATIVE_ERROR
from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError, eos_ids
from specdistill.data.sampling import Sampling
from tests.conftest import free_port, main_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

RESULT_FIELDS = {
    "prompts",
    "samples",
    "skipped_long_prompts",
    "truncated_long_prompts",
    "tokens_generated",
    "tokens_per_s",
    "wall_seconds",
}


def _rows(path) -> list[tuple[int, int, list[int], list[int], str]]:
    ds = datasets.load_from_disk(str(path))
    cols = ("prompt_index", "sample_index", "prompt_ids", "completion_ids", "finish_reason")
    return list(zip(*(ds[c] for c in cols)))


def _prepared(tok, n: int, split: str = "test") -> list[batched.PreparedPrompt]:
    prompts = load_prompts(
        {"source": "toy", "toy": "toy-tiny", "limit": n}, tok, default_split=split
    )
    prepared, _ = fitted_prompts.prepare_prompts(
        prompts, tok, 400, "truncate", add_special_tokens=True
    )
    return prepared


def test_batched_greedy_equals_one_at_a_time_generate(toy_tiny_pair):
    """Left padding and batching change nothing in fp32: same tokens as unpadded, single calls."""
    target, _, tok = toy_tiny_pair
    prompts = _prepared(tok, 12)
    assert len({len(p.ids) for p in prompts}) > 6  # lengths differ, so padding is exercised
    s = batched.GenerationSettings(
        max_new_tokens=12, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
    )
    rows, tokens = batched.generate_rows(target, tok, prompts, s, batch_size=8, topk=0)
    eos = eos_ids(target.generation_config, tok)
    for p, row in zip(prompts, rows):
        with torch.inference_mode():
            out = target.generate(
                torch.tensor([p.ids]),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=eos,
            )
        single, reason = batched.split_completion(out[0, len(p.ids) :].tolist(), eos)
        assert row["prompt_index"] == p.index
        assert row["completion_ids"] == single
        assert row["finish_reason"] == reason
    assert tokens == sum(len(r["completion_ids"]) for r in rows)


def test_run_writes_dataset_with_schema_and_result(generate_cfg, tmp_path):
    res = gen.run(generate_cfg("dataset.limit=9"))
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    assert res.merged and res.samples == 9 and ds.num_rows == 9
    assert ds["prompt_index"] == list(range(9))  # deterministic order, whatever the batching
    for row in ds:
        assert len(row["completion_ids"]) == 6 or row["finish_reason"] == "eos"
        assert row["finish_reason"] in ("eos", "length")
    result = json.loads((tmp_path / "gen" / "result.json").read_text())
    assert set(result) >= RESULT_FIELDS
    assert result["tokens_generated"] == sum(len(c) for c in ds["completion_ids"])
    config = json.loads(ds.info.description)
    assert config["sampling"]["max_new_tokens"] == 6 and config["target"].endswith("target")
    assert config == json.loads((tmp_path / "gen" / "generation_config.json").read_text())


def test_resume_after_crash_generates_only_missing_chunks(generate_cfg, tmp_path, monkeypatch):
    """A crash after 2 of 3 chunks: the restart generates chunk 3 only; each prompt once."""
    out = tmp_path / "gen"
    cfg = generate_cfg("dataset.limit=12")
    written: list[Path] = []
    real_write = gen.write_chunk

    def write_then_die(path, rows, topk, **kw):
        real_write(path, rows, topk, **kw)
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(gen, "write_chunk", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        gen.run(cfg)
    assert not (out / "state.json").exists()
    mtimes = {p: p.stat().st_mtime_ns for p in written}
    monkeypatch.setattr(gen, "write_chunk", real_write)
    generated: list[int] = []
    real_batch = batched.generate_batch

    def counting_batch(model, prompt_ids, gen_config, eos, *topk):
        generated.extend(len(p) for p in prompt_ids)
        return real_batch(model, prompt_ids, gen_config, eos, *topk)

    monkeypatch.setattr(batched, "generate_batch", counting_batch)
    res = gen.run(cfg)
    assert (res.chunks_resumed, res.chunks_generated) == (2, 1)
    assert len(generated) == 4  # the one missing chunk's prompts, nothing else
    assert {p: p.stat().st_mtime_ns for p in written} == mtimes
    assert [r[0] for r in _rows(out)] == list(range(12))
    # A third run finds everything done and generates nothing.
    generated.clear()
    assert gen.run(cfg).chunks_generated == 0 and not generated


def test_two_shards_merged_equal_one_shard(generate_cfg, tmp_path):
    one = gen.run(generate_cfg(out=tmp_path / "one"))
    cfg0 = generate_cfg("shard.index=0", "shard.count=2", out=tmp_path / "two")
    first = gen.run(cfg0)
    assert not first.merged and not (tmp_path / "two" / "state.json").exists()
    with pytest.raises(ConfigError, match=r"shards \[1\] of 2"):
        gen.run(generate_cfg("merge_only=true", out=tmp_path / "two"))
    second = gen.run(generate_cfg("shard.index=1", "shard.count=2", out=tmp_path / "two"))
    assert second.merged and first.prompts + second.prompts == one.prompts == 10
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")
    merged = gen.run(generate_cfg("merge_only=true", out=tmp_path / "two"))
    assert merged.merged and merged.result["samples"] == 10


def test_sampled_run_is_seeded_and_has_n_samples(generate_cfg, tmp_path):
    args = ("sampling.temperature=1.0", "sampling.top_p=0.9", "num_samples=3", "dataset.limit=5")
    gen.run(generate_cfg(*args, out=tmp_path / "a"))
    gen.run(generate_cfg(*args, out=tmp_path / "b"))
    rows = _rows(tmp_path / "a")
    assert [(r[0], r[1]) for r in rows] == [(i, j) for i in range(5) for j in range(3)]
    assert rows == _rows(tmp_path / "b")
    assert len({tuple(r[3]) for r in rows}) > 5  # samples differ from one another


@pytest.mark.parametrize("share", [0.25, 1 / 3, 0.5, 0.7, 1.0])
def test_sampled_prompts_hold_the_share_in_every_window(share):
    """Exact over all windows of 0..119: a prefix holds floor(n * share) sampled prompts, any
    contiguous range (a shard, a chunk) its share to within one."""
    marks = [batched.sampled_prompt(i, share) for i in range(120)]
    for n in range(121):
        assert sum(marks[:n]) == math.floor(n * Fraction(share).limit_denominator(100))
    for a in range(120):
        for b in range(a + 1, 121):
            assert abs(sum(marks[a:b]) - (b - a) * share) < 1 + 1e-9


def test_mixed_run_keeps_greedy_rows_and_samples_the_share(generate_cfg, tmp_path):
    """sampled_share=0.5: the greedy prompts' rows are the greedy run's, token for token; the
    sampled ones are seeded (a rerun draws the same), and the record names the share."""
    mixed = ("sampling.temperature=1.0", "sampled_share=0.5", "dataset.limit=10", "batch_size=3")
    gen.run(generate_cfg(*mixed, out=tmp_path / "a"))
    gen.run(generate_cfg(*mixed, out=tmp_path / "b"))
    gen.run(generate_cfg("dataset.limit=10", "batch_size=3", out=tmp_path / "greedy"))
    rows, greedy = _rows(tmp_path / "a"), _rows(tmp_path / "greedy")
    assert [r[0] for r in rows] == list(range(10)) and rows == _rows(tmp_path / "b")
    sampled = [batched.sampled_prompt(i, 0.5) for i in range(10)]
    assert sum(sampled) == 5
    assert all(r == g for r, g, s in zip(rows, greedy, sampled) if not s)
    assert any(r[3] != g[3] for r, g, s in zip(rows, greedy, sampled) if s)
    record = json.loads((tmp_path / "a" / "generation_config.json").read_text())["sampling"]
    assert record["sampled_share"] == 0.5 and record["temperature"] == 1.0
    plain = json.loads((tmp_path / "greedy" / "generation_config.json").read_text())["sampling"]
    assert "sampled_share" not in plain  # earlier runs' records (and fingerprints) unchanged
    assert json.loads((tmp_path / "a" / "result.json").read_text())["sampled_samples"] == 5


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["sampled_share=0"], r"sampled_share=0 must lie in \(0, 1\]"),
        (["sampled_share=1.5"], r"sampled_share=1\.5 must lie"),
        (["sampled_share=0.5"], r"sampled_share=0\.5 with sampling\.temperature=0"),
        (["sampled_share=0.5", "sampling.temperature=1.0", "num_samples=2"], "num_samples=2"),
    ],
)
def test_bad_sampled_share_is_named(generate_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        GenerateSettings.from_cfg(generate_cfg(*overrides))


def test_topk_logprobs_match_a_direct_forward_pass(generate_cfg, toy_tiny_pair, tmp_path):
    target, _, _ = toy_tiny_pair
    gen.run(generate_cfg("topk_logprobs=5", "dataset.limit=6", "batch_size=3"))
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    for row in ds:
        p, c = row["prompt_ids"], row["completion_ids"]
        ids, lps = torch.tensor(row["topk_ids"]), torch.tensor(row["topk_logprobs"])
        assert ids.shape == lps.shape == (len(c), 5)
        with torch.inference_mode():
            logits = target(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        ref = logits.float().log_softmax(-1)
        # stored as float16: within |l| * 2^-11 of the fp32 value (data/generate/storage.py)
        rtol = F16_RELATIVE_ERROR + 1e-4
        torch.testing.assert_close(lps.float(), ref.gather(-1, ids), atol=1e-4, rtol=rtol)
        torch.testing.assert_close(lps.float(), ref.topk(5).values, atol=1e-4, rtol=rtol)
        assert ids[:, 0].tolist() == c  # greedy: the stored top-1 is the token generated


def test_topk_rides_in_the_generation_config_not_beside_it(toy_tiny_pair, monkeypatch):
    """transformers deprecates `generate(generation_config=..., output_logits=...)` (a warning
    today, an error once removed): the raw logits are asked for inside a copy of the config, and
    the caller's config is left as it was."""
    target, _, tok = toy_tiny_pair
    calls: list[dict] = []
    real = target.generate

    def recording(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(target, "generate", recording)
    s = batched.GenerationSettings(
        max_new_tokens=6, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
    )
    eos = eos_ids(target.generation_config, tok)
    gc = batched.generation_config(s, tok.pad_token_id, eos)
    prompts = [p.ids for p in _prepared(tok, 3)]
    rows, top = batched.generate_batch(target, prompts, gc, eos, topk=4)
    assert top is not None and len(top) == len(rows) == 3  # the logits were kept
    (kw,) = calls
    assert set(kw) == {"input_ids", "attention_mask", "generation_config"}
    assert kw["generation_config"].output_logits and kw["generation_config"].return_dict_in_generate
    assert not gc.output_logits and not gc.return_dict_in_generate


def _cli(*args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdistill.data.generate", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw
    )


def test_cli_interface(toy_tiny, tmp_path):
    out = tmp_path / "cli"
    proc = _cli(
        "pair=toy-tiny",
        f"output_dir={out}",
        "max_new_tokens=4",
        "batch_size=4",
        "dataset.limit=6",
        "progress=false",
        cwd=tmp_path,
    )
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert len(datasets.load_from_disk(str(out))["prompt_ids"]) == 6
    assert set(json.loads((out / "result.json").read_text())) >= RESULT_FIELDS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]  # hydra did not litter cwd


def test_cli_bad_input_is_one_line_and_exit_2(toy_tiny, tmp_path, monkeypatch, capsys):
    """main() turns a ConfigError into one line on stderr and status 2 (in-process: no import)."""
    argv = ["generate", "pair=toy-tiny", f"output_dir={tmp_path}", "max_new_tokens=0"]
    code, err = main_in_process(gen.main, argv, monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: max_new_tokens=0")


@pytest.mark.slow
def test_sigkill_midway_then_restart_finishes_each_prompt_once(toy_tiny, tmp_path):
    # 32 small chunks, so the kill lands midway even when the machine is quick or the poll slow
    # (with 6 chunks of 8, a busy CI machine once saw all 6 written before the kill)
    out, chunks = tmp_path / "killed", 32
    args = (
        "pair=toy-tiny",
        f"output_dir={out}",
        "max_new_tokens=32",
        "batch_size=2",
        "chunk_size=2",
        f"dataset.limit={2 * chunks}",
        "progress=false",
    )
    proc = _cli(*args, start_new_session=True)
    shard = out / "chunks"
    deadline = time.time() + 240
    while not any(shard.glob("*/*/chunk-00001.parquet")) and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = sorted(p.name for p in shard.glob("*/*/chunk-*.parquet"))
    assert 2 <= len(done_before) < chunks and not (out / "state.json").exists()
    proc = _cli(*args)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    result = json.loads((out / "result.json").read_text())
    assert result["shards"][0]["chunks_generated"] == chunks - len(done_before)
    assert [r[0] for r in _rows(out)] == list(range(2 * chunks))


@pytest.mark.slow
def test_accelerate_two_processes_equal_one_process(toy_tiny, tmp_path):
    """Two ranks under `accelerate launch` merge to exactly the one-process dataset (greedy).

    accelerate 1.15's `--cpu --num_processes 2` starts ONE process (its simple launcher; multi-CPU
    needs an mpirun hostfile), so two CPU ranks are launched with `--multi_gpu`, which is
    torchrun underneath and runs on a CPU-only machine too.
    """
    args = [
        "pair=toy-tiny",
        "max_new_tokens=8",
        "batch_size=4",
        "chunk_size=4",
        "dataset.limit=16",
        "progress=false",
    ]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),  # not the default 29500, which another xdist worker's test may hold
    ]
    for cmd, out in (
        ([*launch, "-m", "specdistill.data.generate"], tmp_path / "two"),
        ([sys.executable, "-m", "specdistill.data.generate"], tmp_path / "one"),
    ):
        proc = subprocess.run(
            [*cmd, *args, f"output_dir={out}"], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["shard_count"] == 2
    assert sorted(s["shard_index"] for s in result["shards"]) == [0, 1]
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")


def test_bench_reports_ratios_and_identical_greedy_tokens(generate_cfg, tmp_path):
    from specdistill.data.generate.bench import format_report, run_bench

    cfg = generate_cfg(
        "bench.num_prompts=6", "bench.batch_sizes=[1,4]", f"bench.output={tmp_path}/b.json"
    )
    report = run_bench(cfg)
    assert json.loads((tmp_path / "b.json").read_text()) == report
    base = report["one_at_a_time"]
    assert report["prompts"] == 6 and base["tokens"] > 0
    for entry in report["batched"]:
        assert entry["tokens"] == base["tokens"] and entry["identical_to_one_at_a_time"]
        ratio = entry["tokens_per_s"] / base["tokens_per_s"]
        assert entry["ratio_vs_one_at_a_time"] == pytest.approx(ratio, abs=0.01)
    assert "batched bs=4" in format_report(report)


def test_local_processes_split_the_prompts_and_match_one_process(generate_cfg, tmp_path):
    """processes=2: shard 1 in a spawned process, shard 0 here; the merged dataset is the one
    process's, row for row (top-k included), and a rerun resumes with nothing left to do."""
    common = ("dataset.limit=8", "max_new_tokens=6", "topk_logprobs=3")
    one = gen.run(generate_cfg(*common, out=tmp_path / "one"))
    two_cfg = generate_cfg(*common, "processes=2", out=tmp_path / "two")
    two = gen.run(two_cfg)
    assert two.merged and (two.shard_count, two.samples) == (2, 8)
    assert two.chunks_generated == 2 and two.new_tokens == one.new_tokens  # both shards worked
    assert _rows(one.output_dir) == _rows(two.output_dir)
    a, b = (datasets.load_from_disk(r.output_dir) for r in (one, two))
    assert a["topk_ids"] == b["topk_ids"]
    torch.testing.assert_close(
        torch.tensor(a["topk_logprobs"]), torch.tensor(b["topk_logprobs"]), atol=1e-5, rtol=0
    )
    again = gen.run(two_cfg)
    assert again.chunks_generated == 0 and again.chunks_resumed == 2


def test_processes_setting(generate_cfg):
    def processes(*overrides: str) -> int:
        return local_processes(GenerateSettings.from_cfg(generate_cfg(*overrides)))

    assert processes("processes=3") == 3
    assert processes("processes=auto", "device=cpu") == min(usable_cores(), 8)
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
    # an explicit shard (a Slurm array task, a launcher rank) is one process already
    assert processes("processes=2", "shard.index=0", "shard.count=2") == 1
    for bad in ("processes=0", "processes=two"):
        with pytest.raises(ConfigError, match="processes="):
            processes(bad)
    with pytest.raises(ConfigError, match="backend=vllm"):
        processes("processes=2", "backend=vllm")
