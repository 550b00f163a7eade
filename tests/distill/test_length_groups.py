"""`group_by_length` (distill/train/data.py): micro-batches of rows of similar length, each row
still read once an epoch, the plain stream unchanged when it is off."""

from __future__ import annotations

import random

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.train.data import StreamSpec, grouped_by_length
from specdistill.distill.train.settings import TrainSettings


def _lengths(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)  # chat-like: many short rows, a long tail cut at 256
    return tuple(min(256, int(rng.lognormvariate(4.6, 0.7))) for _ in range(n))


def test_grouped_by_length_sorts_each_run_and_keeps_the_permutation():
    lengths = _lengths(50)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(1))
    out = grouped_by_length(perm, lengths, 16)
    assert sorted(out.tolist()) == list(range(50))
    for start in range(0, 50, 16):  # brute force: each run is its own entries, longest first
        run, mine = perm[start : start + 16].tolist(), out[start : start + 16].tolist()
        assert sorted(run) == sorted(mine)
        assert [lengths[i] for i in mine] == sorted((lengths[i] for i in run), reverse=True)
        ties = [i for i in run if lengths[i] == lengths[mine[0]]]
        assert [i for i in mine if lengths[i] == lengths[mine[0]]] == ties  # stable


def _padded(spec: StreamSpec, lengths, micro_batches: int) -> int:
    return sum(
        max(lengths[i] for i in spec.indices(g)) * spec.micro_batch_size
        for g in range(micro_batches)
    )


def test_grouped_stream_reads_every_row_once_an_epoch_and_pads_less():
    n, mbs = 96, 8
    lengths = _lengths(n)
    plain = StreamSpec(n, mbs, 2, 1, 3, 0, lengths)
    grouped = StreamSpec(n, mbs, 2, 1, 3, 4, lengths)
    per_epoch = n // mbs
    for epoch in range(2):
        seen = [i for g in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                for i in grouped.indices(g)]  # fmt: skip
        assert sorted(seen) == list(range(n))
    assert _padded(grouped, lengths, 2 * per_epoch) < 0.85 * _padded(plain, lengths, 2 * per_epoch)
    # off: exactly the plain permutation's micro-batches, with or without lengths
    bare = StreamSpec(n, mbs, 2, 1, 3)
    assert all(plain.indices(g) == bare.indices(g) for g in range(3 * per_epoch))


def test_layout_records_grouping_only_when_on():
    lengths = _lengths(10)
    assert StreamSpec(10, 2, 1, 1, 0, 0, lengths).layout == {
        "num_examples": 10, "micro_batch_size": 2, "world_size": 1, "grad_accum": 1, "seed": 0,
    }  # fmt: skip
    assert StreamSpec(10, 2, 1, 1, 0, 4, lengths).layout["group_by_length"] == 4


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_group_by_length_is_one_line(distill_cfg, tmp_path, value):
    with pytest.raises(ConfigError, match=r"^group_by_length=.* must be a whole number"):
        TrainSettings.from_cfg(distill_cfg(tmp_path, f"group_by_length={value}"))
