"""Seq-KD rows read lazily (distill/train/seqkd_rows.py): the same Examples the eager reader
built, nothing per row until a micro-batch asks, and a rank touching only its own rows."""

from __future__ import annotations

from collections import Counter

import datasets
import numpy as np
import pytest

from specdistill.data.generate.merge import merge_shards
from specdistill.data.generate.synthetic import synthetic_run
from specdistill.data.runtime import ConfigError
from specdistill.decode.draft_vocab import choose_draft_vocab
from specdistill.distill.train import seqkd_rows
from specdistill.distill.train.data import (
    Example,
    StreamSpec,
    collate,
    collated_lengths,
    load_seqkd,
    prompts_cut,
)


@pytest.fixture
def merged(tmp_path):
    run = synthetic_run(tmp_path / "run", 23, prompt_len=7, completion_len=6, k=5, vocab=200)
    merge_shards(run, budget_bytes=2_000)
    return run


def _eager(path, limit=None) -> list[Example]:
    """What load_seqkd built before rows were read lazily: every row as Python lists."""
    ds = datasets.load_from_disk(str(path))
    rows = ds.select(range(min(limit, len(ds)))) if limit else ds
    return [
        Example(
            list(r["prompt_ids"]),
            list(r["completion_ids"]),
            r.get("topk_ids"),
            r.get("topk_logprobs"),
        )
        for r in rows
        if r["completion_ids"]
    ]


def _same(a: Example, b: Example) -> None:
    assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
    assert np.asarray(a.topk_ids).tolist() == np.asarray(b.topk_ids).tolist()
    assert (
        np.asarray(a.topk_logprobs, np.float64).tolist()
        == np.asarray(b.topk_logprobs, np.float64).tolist()
    )


def test_lazy_rows_equal_the_eager_ones(merged):
    rows = load_seqkd(merged)
    eager = _eager(merged)
    assert len(rows) == len(eager) == 23
    for a, b in zip(rows, eager):
        _same(a, b)
    _same(rows[-1], eager[-1])
    for a, b in zip(rows[3:9], eager[3:9]):
        _same(a, b)
    assert rows[0].topk_ids.dtype == np.int32 and rows[0].topk_logprobs.dtype == np.float16
    assert collated_lengths(rows, 10) == tuple(
        min(len(e.prompt_ids) + len(e.completion_ids), 10) for e in eager
    )
    assert prompts_cut(rows, 12) == sum(len(e.prompt_ids) + 6 > 12 for e in eager)
    batch, ref = collate(rows[:4], 0, 64), collate(eager[:4], 0, 64)
    assert all((batch[k] == ref[k]).all() for k in ref)
    assert seqkd_rows.topk_width(rows) == 5
    no_topk = seqkd_rows.without_topk(rows)
    assert not seqkd_rows.has_topk(no_topk) and no_topk[0].topk_ids is None


def test_a_dataset_of_the_older_layout_reads_the_same(tmp_path):
    """Nested int64 / fp32 lists (before storage.py), rows with an empty completion skipped,
    `limit` counting stored rows as before."""
    rows = [
        {
            "prompt_ids": [1, 2, 3][: i % 3 + 1],
            "completion_ids": [] if i % 4 == 0 else [4, 5][: i % 2 + 1],
            "topk_ids": [] if i % 4 == 0 else [[4, 6], [5, 7]][: i % 2 + 1],
            "topk_logprobs": [] if i % 4 == 0 else [[-0.5, -1.5], [-0.25, -2.0]][: i % 2 + 1],
        }
        for i in range(11)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "old"))
    for limit in (None, 6):
        lazy, eager = load_seqkd(tmp_path / "old", limit=limit), _eager(tmp_path / "old", limit)
        assert len(lazy) == len(eager) == (8 if limit is None else 4)
        for a, b in zip(lazy, eager):
            _same(a, b)


def test_nothing_is_built_per_row_until_a_micro_batch_asks(merged, monkeypatch):
    """Opening the rows, their lengths, cuts, top-k presence and token counts build no Example;
    rank 0 of 2 builds exactly its micro-batches' rows."""
    built: list[int] = []
    real = seqkd_rows.SeqKDRows._row

    def counting(self, j):
        built.append(j)
        return real(self, j)

    monkeypatch.setattr(seqkd_rows.SeqKDRows, "_row", counting)
    rows = load_seqkd(merged)
    collated_lengths(rows, 8), prompts_cut(rows, 8), seqkd_rows.has_topk(rows)
    list(seqkd_rows.token_arrays(rows))
    assert built == []
    stream = StreamSpec(len(rows), 3, world_size=2, grad_accum=1, seed=5)
    mine = [i for step in range(3) for i in stream.indices(stream.global_micro_index(step, 0, 0))]
    theirs = [i for step in range(3) for i in stream.indices(stream.global_micro_index(step, 0, 1))]
    for i in mine:
        rows[i]
    assert sorted(built) == sorted(mine)
    assert not set(built) & set(theirs)


def test_a_chain_indexes_like_the_concatenated_list(merged):
    rows = load_seqkd(merged)
    extra = [Example([9, 9], [8]), Example([7], [6, 5], prompt_head=1)]
    chained = seqkd_rows.chain([rows, [], extra])
    flat = [*rows, *extra]
    assert len(chained) == len(flat) == 25
    for i in (0, 5, 22, 23, 24, -1, -25):
        a, b = chained[i], flat[i]
        assert a.prompt_ids == b.prompt_ids and a.prompt_head == b.prompt_head
    assert [e.completion_ids for e in chained[21:25]] == [e.completion_ids for e in flat[21:]]
    with pytest.raises(IndexError):
        chained[25]
    assert not seqkd_rows.has_topk(chained)  # the reference rows carry none
    assert seqkd_rows.has_topk(seqkd_rows.chain([rows]))
    p, c = seqkd_rows.lengths(chained)
    assert p.tolist() == [len(e.prompt_ids) for e in flat]
    assert c.tolist() == [len(e.completion_ids) for e in flat]


def test_draft_vocabulary_counts_flat_arrays_like_lists():
    """bincount over flat arrays ranks tokens as the Counter over lists did (ties: lower id)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(-2, 60, int(rng.integers(0, 30))).tolist() for _ in range(40)]
    counts = Counter(t for s in seqs for t in s if 0 <= t < 50)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    for size in (5, 20, 49):
        want = list(dict.fromkeys([3, *ranked]))[:size]
        want += [t for t in range(50) if t not in want][: size - len(want)]
        assert choose_draft_vocab(seqs, 50, size, [3]) == want
        assert choose_draft_vocab((np.array(s) for s in seqs), 50, size, [3]) == want


def test_bad_paths_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_seqkd(tmp_path / "nowhere")
    datasets.Dataset.from_list([{"prompt_ids": [1], "completion_ids": []}]).save_to_disk(
        str(tmp_path / "empty")
    )
    with pytest.raises(ConfigError, match="no rows with a non-empty completion"):
        load_seqkd(tmp_path / "empty")
