"""Seq-KD storage: the compact top-k layout's round trip and error bound, and the streaming merge.

The merge's bucket sort is checked against the order and content a whole-table sort gives, on
synthetic runs (`generate/synthetic.py`) small enough to merge in a fraction of a second.
"""

from __future__ import annotations

import json
import shutil

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specdistill.data.generate.merge import merge_shards
from specdistill.data.generate.storage import (
    F16_RELATIVE_ERROR,
    LOGPROB_MIN,
    chunk_schema,
    logprob_error_bound,
    rows_table,
    topk_bytes,
)
from specdistill.data.generate.synthetic import synthetic_run
from specdistill.distill.losses import topk_logprobs


def _rows(rng: np.random.Generator, n: int, k: int, vocab: int = 500) -> list[dict]:
    rows = []
    for i in range(n):
        positions = int(rng.integers(1, 9))
        p = rng.dirichlet(np.full(vocab, 0.1), size=positions)
        ids = np.argsort(-p, axis=-1)[:, :k]
        rows.append(
            {
                "prompt_index": i,
                "sample_index": 0,
                "prompt": f"p{i}",
                "prompt_ids": rng.integers(0, vocab, 5).tolist(),
                "completion": f"c{i}",
                "completion_ids": ids[:, 0].tolist(),
                "finish_reason": "eos",
                "topk_ids": ids.tolist(),
                "topk_logprobs": np.log(np.take_along_axis(p, ids, -1)).tolist(),
            }
        )
    return rows


def _read(table: pa.Table, name: str, row: int) -> np.ndarray:
    cell = table.column(name).combine_chunks()[row]
    return np.array(cell.as_py(), dtype=np.float64)


def test_round_trip_ids_exact_logprobs_within_the_stated_error(tmp_path):
    rng = np.random.default_rng(0)
    rows = _rows(rng, 12, k=8)
    rows[0]["topk_logprobs"][0][-1] = -1e6  # below float16's range
    rows[1]["topk_logprobs"][0][-1] = float("-inf")
    pq.write_table(rows_table(rows, 8), tmp_path / "chunk.parquet")
    table = pq.read_table(tmp_path / "chunk.parquet")
    assert table.schema.equals(chunk_schema(8))
    for r, row in enumerate(rows):
        assert _read(table, "topk_ids", r).astype(int).tolist() == row["topk_ids"]
        assert _read(table, "completion_ids", r).astype(int).tolist() == row["completion_ids"]
        got, want = _read(table, "topk_logprobs", r), np.array(row["topk_logprobs"])
        assert np.isfinite(got).all()  # -inf and -1e6 stored as float16's lowest, -65504
        want = np.maximum(want, LOGPROB_MIN)
        assert (np.abs(got - want) <= np.abs(want) * F16_RELATIVE_ERROR + 2.0**-25).all()
    assert _read(table, "topk_logprobs", 0)[0][-1] == LOGPROB_MIN


def test_acceptance_moves_within_the_bound(tmp_path):
    """The stored-top-k acceptance (target top-k + a rest bucket against the drafter's full
    distribution) from float16 log-probs is within 2 * logprob_error_bound of the fp32 one."""
    rng = np.random.default_rng(1)
    rows = _rows(rng, 40, k=16, vocab=300)
    table = rows_table(rows, 16)
    for r, row in enumerate(rows):
        ids = torch.tensor(row["topk_ids"])
        lp32 = torch.tensor(row["topk_logprobs"], dtype=torch.float64)
        lp16 = torch.tensor(_read(table, "topk_logprobs", r))
        q = torch.randn(ids.shape[0], 300, dtype=torch.float64) * 3
        a32 = _alpha(*topk_logprobs(q, ids, lp32))
        a16 = _alpha(*topk_logprobs(q, ids, lp16))
        bound = 2 * torch.tensor(logprob_error_bound(lp32.numpy()))
        assert ((a32 - a16).abs() <= bound).all()
        assert (bound < 2 * 2.0**-11 * np.log(16) * 1.01 + 1e-5).all()  # <= 2^-10 ln K


def _alpha(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return torch.minimum(lp.exp(), lq.exp()).sum(-1)


def test_top_k_takes_at_most_7_bytes_an_entry():
    rows = _rows(np.random.default_rng(2), 30, k=32, vocab=4000)
    size, entries = topk_bytes(rows_table(rows, 32))
    assert entries == sum(len(r["topk_ids"]) for r in rows) * 32
    assert size / entries <= 7  # 4 (int32 id) + 2 (float16) + offsets per position / K


def test_a_row_of_the_wrong_width_is_refused():
    rows = _rows(np.random.default_rng(3), 2, k=4)
    rows[1]["topk_ids"] = [ids[:3] for ids in rows[1]["topk_ids"]]
    with pytest.raises(ValueError, match=r"\[positions, 4\]"):
        rows_table(rows, 4)


def _synthetic(tmp_path, name: str, **kw):
    settings = {"prompts": 37, "prompt_len": 6, "completion_len": 5, "k": 4, "chunk_size": 4}
    settings |= {"shards": 3} | kw
    return synthetic_run(tmp_path / name, settings.pop("prompts"), vocab=300, **settings)


def test_bucket_merge_equals_a_whole_table_sort(tmp_path):
    """Tiny budgets (many buckets, several dataset files) merge to the rows a whole-table sort
    gives, in (prompt_index, sample_index) order, readable by `load_from_disk`."""
    whole = _synthetic(tmp_path, "whole")
    parts = _synthetic(tmp_path, "parts")
    merge_shards(whole)
    res = merge_shards(parts, budget_bytes=1_000, shard_bytes=2_000)
    assert res["storage"]["merge_buckets"] > 5
    assert len(list(parts.glob("data-*.arrow"))) > 1
    assert res["samples"] == res["prompts"] == 37
    assert res["tokens_generated"] == 37 * 5
    assert res["storage"]["topk_bytes_per_entry"] <= 7
    a, b = datasets.load_from_disk(str(whole)), datasets.load_from_disk(str(parts))
    assert a["prompt_index"] == b["prompt_index"] == list(range(37))
    assert a.to_dict() == b.to_dict()
    files = sorted((whole / "chunks").rglob("chunk-*.parquet"))
    by_sort = pa.concat_tables([pq.read_table(f) for f in files]).sort_by("prompt_index")
    assert by_sort.to_pylist() == b.to_list()
    assert json.loads((parts / "result.json").read_text())["storage"] == res["storage"]


def test_chunks_of_the_replaced_layout_are_cast(tmp_path):
    """Chunks written before the compact layout (int64 ids, fp32 log-probs) merge into it."""
    old = _synthetic(tmp_path, "old", layout="replaced")
    new = _synthetic(tmp_path, "new")
    merge_shards(old, budget_bytes=2_000)
    merge_shards(new)
    a, b = datasets.load_from_disk(str(old)), datasets.load_from_disk(str(new))
    assert a.features == b.features
    for name in a.column_names:
        if name != "topk_logprobs":
            assert a[name] == b[name]
    # fp64 -> fp16 (new) against fp64 -> fp32 -> fp16 (old): at most one float16 step apart
    lp_old = np.concatenate([np.ravel(x) for x in a["topk_logprobs"]])
    lp_new = np.concatenate([np.ravel(x) for x in b["topk_logprobs"]])
    assert np.allclose(lp_old, lp_new, rtol=2.0**-10, atol=0)


def test_a_missing_chunk_is_named(tmp_path):
    run = _synthetic(tmp_path, "gap")
    victim = sorted((run / "chunks").rglob("chunk-*.parquet"))[2]
    lost = pq.read_table(victim).column("prompt_index").to_pylist()
    victim.unlink()
    with pytest.raises(RuntimeError, match=r"rows do not match the plan for prompts") as e:
        merge_shards(run, budget_bytes=1_000)
    assert str(sorted(lost)[:10]) in str(e.value)
    assert not (run / "state.json").exists()
    assert not list(run.glob(".merge-tmp-*"))  # the temp folder is removed


def test_a_row_outside_the_plan_is_named(tmp_path):
    """A chunk holding a prompt no shard planned (index below every planned one) is caught."""
    run = _synthetic(tmp_path, "stray")
    victim = sorted((run / "chunks").rglob("chunk-*.parquet"))[0]
    table = pq.read_table(victim)
    index = table.column_names.index("prompt_index")
    stray = pa.array([-5, *table.column(index).to_pylist()[1:]], pa.int64())
    pq.write_table(table.set_column(index, "prompt_index", stray), victim)
    with pytest.raises(RuntimeError, match=r"rows do not match the plan for prompts \[-5"):
        merge_shards(run, budget_bytes=1_000)


def test_a_killed_merge_is_redone_from_the_chunks(tmp_path, monkeypatch):
    from specdistill.data.generate import merge

    run = _synthetic(tmp_path, "killed")
    real = merge.DatasetWriter.write
    calls = {"n": 0}

    def dies(self, table):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(self, table)

    monkeypatch.setattr(merge.DatasetWriter, "write", dies)
    with pytest.raises(KeyboardInterrupt):
        merge_shards(run, budget_bytes=1_000)
    assert not (run / "state.json").exists() and not list(run.glob(".merge-tmp-*"))
    monkeypatch.setattr(merge.DatasetWriter, "write", real)
    assert merge_shards(run, budget_bytes=1_000)["samples"] == 37
    shutil.rmtree(run / "chunks")  # merged: the dataset stands without them
    assert len(datasets.load_from_disk(str(run))) == 37
