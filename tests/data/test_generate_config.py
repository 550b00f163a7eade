"""The generate stage's guards: bad input named before heavy work, long prompts, config drift."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter

import datasets
import pytest

from specdistill.data.generate import stage as gen
from specdistill.data.generate.batched import split_completion
from specdistill.data.generate.shards import plan_shard, resolve_shard
from specdistill.data.runtime import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["max_new_tokens=0"], "max_new_tokens"),
        (["max_new_tokens=600"], "max_new_tokens"),  # over toy-tiny's 512-token context
        (["batch_size=0"], "batch_size"),
        (["num_samples=0"], "num_samples"),
        (["num_samples=2"], "num_samples"),  # greedy copies
        (["sampling.temperature=-0.5"], "sampling.temperature"),
        (["sampling.top_p=0"], "sampling.top_p"),
        (["sampling.top_p=1.5"], "sampling.top_p"),
        (["sampling.top_k=-1"], "sampling.top_k"),
        (["sampling.top_k=2.5"], "sampling.top_k"),
        (["chunk_size=0"], "chunk_size"),
        (["topk_logprobs=-1"], "topk_logprobs"),
        (["topk_logprobs=100000"], "topk_logprobs"),
        (["long_prompts=drop"], "long_prompts"),
        (["max_prompt_tokens=0"], "max_prompt_tokens"),
        (["shard.index=2", "shard.count=2"], "shard.index"),
        (["pair.target=/no/such/checkpoint"], "pair.target"),
        (["dataset.field=nope"], "dataset.field"),
        (["dataset.split=validation"], "dataset.split"),
        (["long_prompts=skip", "max_prompt_tokens=1"], "long_prompts"),  # nothing left
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(generate_cfg, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        gen.run(generate_cfg(*overrides))
    assert not (tmp_path / "gen" / "chunks").exists()  # refused before any generation


def test_empty_prompt_file_is_a_config_error(generate_cfg, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"dataset\.path"):
        gen.run(generate_cfg("dataset=jsonl", f"dataset.path={empty}"))


def test_tokenizer_without_pad_token_uses_eos_with_a_warning(
    generate_cfg, toy_tiny, tmp_path, caplog
):
    target = tmp_path / "target"
    shutil.copytree(toy_tiny.target_dir, target)
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    tok_cfg["pad_token"] = None
    (target / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with caplog.at_level(logging.WARNING):
        res = gen.run(generate_cfg(f"pair.target={target}", f"pair.tokenizer={target}"))
    assert res.merged and res.samples == 10
    assert any("no pad token" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_long_prompts_are_truncated_or_skipped_and_counted(generate_cfg, tmp_path, policy):
    res = gen.run(generate_cfg(f"long_prompts={policy}", "max_prompt_tokens=64"))
    result = json.loads((tmp_path / "gen" / "result.json").read_text())
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    assert all(len(ids) <= 64 for ids in ds["prompt_ids"])
    if policy == "truncate":
        assert result["truncated_long_prompts"] > 0 and result["skipped_long_prompts"] == 0
        assert ds.num_rows == 10
    else:
        assert result["skipped_long_prompts"] > 0 and result["truncated_long_prompts"] == 0
        assert ds.num_rows == res.samples == 10 - result["skipped_long_prompts"]


def test_restart_with_another_config_is_refused_unless_overwrite(generate_cfg, tmp_path):
    gen.run(generate_cfg())
    with pytest.raises(ConfigError, match=r"differs in .*sampling.*overwrite=true"):
        gen.run(generate_cfg("max_new_tokens=5"))
    res = gen.run(generate_cfg("max_new_tokens=5", "overwrite=true"))
    assert res.chunks_generated == 3 and res.merged
    assert len(list((tmp_path / "gen" / "chunks").iterdir())) == 1  # the old run's chunks went
    ds = datasets.load_from_disk(str(tmp_path / "gen"))
    assert max(len(c) for c in ds["completion_ids"]) == 5


def test_batch_size_is_not_part_of_the_config_fingerprint(generate_cfg):
    """A resume may change throughput knobs: batch size does not change greedy output."""
    gen.run(generate_cfg("batch_size=4"))
    assert gen.run(generate_cfg("batch_size=2")).chunks_generated == 0


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shard_plans_cover_every_prompt_once(count):
    lengths = {i: (i * 37) % 11 for i in range(23)}
    plans = [plan_shard(lengths, i, count, chunk_size=4) for i in range(count)]
    flat = [i for plan in plans for chunk in plan for i in chunk]
    assert Counter(flat) == Counter(range(23))
    for plan in plans:
        assert all(1 <= len(c) <= 4 for c in plan)
        seen = [lengths[i] for c in plan for i in c]
        assert seen == sorted(seen)  # length-sorted, so batches pad little


def test_resolve_shard_reads_the_launcher_environment():
    assert resolve_shard(None, None, {"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)
    assert resolve_shard(None, None, {}) == (0, 1)
    assert resolve_shard(3, 4, {"RANK": "1", "WORLD_SIZE": "2"}) == (3, 4)
    with pytest.raises(ConfigError, match="shard.count"):
        resolve_shard(0, 0, {})


def test_split_completion_keeps_the_first_eos():
    assert split_completion([5, 6, 0, 1, 1], [0]) == ([5, 6, 0], "eos")
    assert split_completion([5, 6, 7], [0, 9]) == ([5, 6, 7], "length")
