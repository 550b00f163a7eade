"""Bad input, foreign or broken checkpoints and a full disk: each stage's CLI says so in one line.

One table of bad inputs, run through every stage's Hydra `main` in this process: each must end
with exit status 2 and a single `error:` line (the last one on stderr, no traceback) that
names the field or the file at fault, before any model loads. Then write faults: a writer
patched to raise ENOSPC ends in exit status 3 and one line with the path; nothing half-written
is left, and the rerun resumes from what finished.
"""

from __future__ import annotations

import errno
import importlib
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdistill.data.models.pairs import resolve_pair
from specdistill.data.runtime import ConfigError
from tests.conftest import STAGE_MODULES, main_in_process

STAGES = {**STAGE_MODULES, "pipeline": "specdistill.distill.pipeline.stage"}


def _save_tokenizer_files(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


def build_fixtures(root: Path, world) -> Path:
    """The broken and foreign checkpoints of the table, built from the toy-tiny world."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    from specdistill.data.toy.world import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    # The case: a random GPT-2 with a 1000-token vocabulary, saved without a tokenizer.
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=1000, n_embd=32, n_layer=1, n_head=2, n_positions=512)
    )
    gpt2.save_pretrained(root / "gpt2-1000")
    # The toy drafter's weights beside another tokenizer (the same 512 rows).
    drafter = LlamaForCausalLM.from_pretrained(world.drafter_dir)
    drafter.save_pretrained(root / "foreign-tok")
    other = train_tokenizer(
        ["completely different text about cats " * 40, "zzz yyy 123 " * 40], 400
    )
    other.save_pretrained(root / "foreign-tok")
    # The same weights beside a tokenizer sharing no token with the toy one (no byte pieces).
    from tests.data.vocab_fixtures import save, unigram_metaspace

    drafter.save_pretrained(root / "no-overlap")
    save(unigram_metaspace(["ꙮ", "▁ꙮꙮ"]), root / "no-overlap", unk_token="<unk>")
    data = json.loads((root / "no-overlap" / "tokenizer.json").read_text())
    data["model"]["vocab"] = [v for v in data["model"]["vocab"] if not v[0].startswith("<0x")]
    (root / "no-overlap" / "tokenizer.json").write_text(json.dumps(data))
    # Half of model.safetensors missing (target and drafter).
    for role, src in (("target", world.target_dir), ("drafter", world.drafter_dir)):
        dst = root / f"truncated-{role}"
        shutil.copytree(src, dst)
        with open(dst / "model.safetensors", "r+b") as f:
            f.truncate((dst / "model.safetensors").stat().st_size // 2)
    # A sharded drafter whose second shard is missing.
    sharded = root / "sharded-drafter"
    drafter.save_pretrained(sharded, max_shard_size="100KB")
    _save_tokenizer_files(world.drafter_dir, sharded)
    sorted(sharded.glob("model-*.safetensors"))[-1].unlink()
    (root / "bad.jsonl").write_text('{"prompt": "def f():"}\nnot json at all\n')
    (root / "empty.jsonl").write_text('{"prompt": ""}\n{"prompt": ""}\n')
    return root


@pytest.fixture(scope="module")
def fx(tmp_path_factory, toy_tiny) -> Path:
    return build_fixtures(tmp_path_factory.mktemp("bad_inputs"), toy_tiny)


@dataclass(frozen=True)
class Case:
    id: str
    stage: str
    args: tuple[str, ...]
    expect: tuple[str, ...]  # substrings of the error line (the field or the file at fault)


FOREIGN = ("pair.drafter='{fx}/gpt2-1000' has no tokenizer files", "vocab_size 1000")
TRUNCATED_D = ("pair.drafter='{fx}/truncated-drafter'", "model.safetensors is truncated")
TRUNCATED_T = ("pair.target='{fx}/truncated-target'", "model.safetensors is truncated")
OTHER_TOK = ("pair.drafter='{fx}/foreign-tok' uses a different tokenizer", "shared ids")
OTHER_AUTO = ("pair.drafter='{fx}/foreign-tok' has its own tokenizer", "coverage 50.6%")
LOW_COVERAGE = ("has another tokenizer", "50.6%", "below pair.min_vocab_coverage=0.9")
NO_OVERLAP = ("pair.drafter='{fx}/no-overlap' shares no token with pair.target's tokenizer",)
SMALL_VALIDATE = ("num_prompts=1", "max_new_tokens=4", "repeats=1", "step_time_iters=1")
CASES = [
    Case("gamma-negative", "validate", ("decoder.gamma=-1",), ("decoder.gamma=-1",)),
    Case("gamma-non-numeric", "validate", ("decoder.gamma=abc",), ("decoder.gamma='abc'",)),
    Case("target-missing", "validate", ("pair.target=/nonexistent/t",), ("pair.target=",)),
    Case("max-new-tokens-0", "validate", ("max_new_tokens=0",), ("max_new_tokens=0",)),
    Case("batch-size-0", "validate", ("batch_size=0",), ("batch_size=0",)),
    Case("gpt2-drafter", "validate", ("pair.drafter={fx}/gpt2-1000", *SMALL_VALIDATE), FOREIGN),
    Case(
        "other-tokenizer",
        "validate",
        ("pair.drafter={fx}/foreign-tok", "pair.vocab=shared"),
        OTHER_TOK,
    ),
    # validate and distill run mapped pairs now; the online stage still refuses them
    Case("other-tokenizer-auto", "online", ("pair.drafter={fx}/foreign-tok",), OTHER_AUTO),
    Case(
        "low-coverage",
        "validate",
        ("pair.drafter={fx}/foreign-tok", "pair.min_vocab_coverage=0.9"),
        LOW_COVERAGE,
    ),
    Case("no-overlap", "validate", ("pair.drafter={fx}/no-overlap",), NO_OVERLAP),
    Case(
        "mapped-distill",
        "distill",
        # distill trains mapped pairs; on-policy batches are what it still refuses
        ("pair.drafter={fx}/foreign-tok", "pair.min_vocab_coverage=0", "logger=none", "lmbda=0.5"),
        ("lmbda=0.5: on-policy batches are not supported for a drafter with its own tokenizer",),
    ),
    Case("vocab-mode", "validate", ("pair.vocab=sometimes",), ("pair.vocab='sometimes'",)),
    Case("truncated-target", "validate", ("pair.target={fx}/truncated-target",), TRUNCATED_T),
    Case("truncated-drafter", "validate", ("pair.drafter={fx}/truncated-drafter",), TRUNCATED_D),
    Case(
        "missing-shard",
        "validate",
        ("pair.drafter={fx}/sharded-drafter",),
        ("pair.drafter=", "model-00002-of-00002.safetensors", "missing"),
    ),
    Case(
        "jsonl-missing",
        "generate",
        ("dataset=jsonl", "dataset.path={fx}/none.jsonl"),
        ("dataset.path='{fx}/none.jsonl' does not exist",),
    ),
    Case(
        "jsonl-malformed",
        "generate",
        ("dataset=jsonl", "dataset.path={fx}/bad.jsonl"),
        ("dataset.path='{fx}/bad.jsonl'",),
    ),
    Case(
        "jsonl-all-empty",
        "generate",
        ("dataset=jsonl", "dataset.path={fx}/empty.jsonl"),
        ("every one of the 2 prompts in dataset.field='prompt' is empty",),
    ),
    Case(
        "copy-k-below-3",
        "distill",
        ("pair.drafter_layers=copy:1", "logger=none"),
        ("pair.drafter_layers='copy:1'", "copy:K needs K >= 3"),
    ),
    Case("generate-batch-0", "generate", ("batch_size=0",), ("batch_size=0",)),
    Case(
        "long-bucket-reversed",
        "validate",
        ("dataset=stdlib-long", "dataset.bucket=8k-4k"),
        ("dataset.bucket='8k-4k' is not a bucket",),
    ),
    Case("long-prompts-unknown", "validate", ("long_prompts=wrap",), ("long_prompts='wrap'",)),
    Case(
        "generate-long-prompts-error",
        "generate",
        (  # the set of tests/data/test_long_prompts.py's generate test: one cached computation
            "dataset=stdlib-long",
            "dataset.buckets=[0-256,1k-2k]",
            "dataset.per_bucket=1",
            "dataset.limit=null",
            "long_prompts=error",
        ),
        ("1 of 2 prompts are longer than", "long_prompts=truncate"),
    ),
    Case("generate-threads-0", "generate", ("threads=0",), ("threads=0",)),
    Case(
        "distill-freeze",
        "distill",
        ("freeze_embeddings=sometimes", "logger=none"),
        ("freeze_embeddings='sometimes'",),
    ),
    Case("generate-truncated", "generate", ("pair.target={fx}/truncated-target",), TRUNCATED_T),
    Case("lmbda-1.5", "distill", ("lmbda=1.5", "logger=none"), ("lmbda=1.5",)),
    Case("distill-truncated", "distill", ("pair.drafter={fx}/truncated-drafter",), TRUNCATED_D),
    Case("distill-gpt2", "distill", ("pair.drafter={fx}/gpt2-1000", "logger=none"), FOREIGN),
    Case(
        "online-unknown-source",
        "online",
        ("stream=[{{dataset: nosuch, requests: 4}}]", "logger=none"),
        ("stream[0].dataset='nosuch'",),
    ),
    Case("online-truncated", "online", ("pair.drafter={fx}/truncated-drafter",), TRUNCATED_D),
    Case("online-gpt2", "online", ("pair.drafter={fx}/gpt2-1000", "logger=none"), FOREIGN),
    Case(
        "export-no-drafter",
        "export",
        ("drafter=/nonexistent/drafter",),
        ("drafter='/nonexistent/drafter' is not a saved checkpoint",),
    ),
    Case(
        "export-truncated",
        "export",
        ("drafter={fx}/truncated-drafter",),
        ("drafter='{fx}/truncated-drafter'", "model.safetensors is truncated"),
    ),
    Case(
        "export-gpt2",
        "export",
        ("drafter={fx}/gpt2-1000",),
        ("drafter='{fx}/gpt2-1000' has no tokenizer files",),
    ),
    Case(
        "export-other-tokenizer",
        "export",
        ("drafter={fx}/foreign-tok",),
        ("drafter='{fx}/foreign-tok' uses a different tokenizer",),
    ),
    Case(
        "export-bad-hub-repo",
        "export",
        ("push_to_hub=my-org/bad--name",),
        ("push_to_hub='my-org/bad--name' is not a valid hub repo id", "write ORG/NAME"),
    ),
    Case(
        "pipeline-truncated",
        "pipeline",
        ("pair.drafter={fx}/truncated-drafter", "generate.dataset.limit=4"),
        TRUNCATED_D,
    ),
]


def case_argv(case: Case, fx: Path, out: Path) -> list[str]:
    """The CLI overrides of one case (toy-tiny pair, output under `out`)."""
    key = "run_dir" if case.stage == "pipeline" else "output_dir"
    return ["pair=toy-tiny", f"{key}={out}", *(a.format(fx=fx) for a in case.args)]


def _main(stage: str):
    return importlib.import_module(STAGES[stage]).main


def _library_handlers_on_this_stderr(monkeypatch) -> None:
    """Libraries (datasets) keep a StreamHandler on the stderr they were imported under
    (closed by now: a logging error with a traceback): point them at this test's."""
    for logger in list(logging.root.manager.loggerDict.values()):
        for h in getattr(logger, "handlers", []):
            stream = getattr(h, "stream", None)
            if type(h) is logging.StreamHandler and stream not in (sys.stderr, sys.stdout):
                monkeypatch.setattr(h, "stream", sys.stderr)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_error_line_and_exit_2(case, fx, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = [STAGES[case.stage], *case_argv(case, fx, out)]
    _library_handlers_on_this_stderr(monkeypatch)
    code, lines = main_in_process(_main(case.stage), argv, monkeypatch, capsys)
    assert code == 2, lines[-5:]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-5:]
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    for text in case.expect:
        assert text.format(fx=fx) in errors[0], errors[0]


# ------------------------------------------------------------------- what is accepted


def test_padding_rows_with_the_same_tokenizer_are_accepted(toy_tiny, tmp_path):
    """The same tokenizer with more (padding) rows: accepted; the vocab check pads/trims."""
    from transformers import LlamaForCausalLM

    d = LlamaForCausalLM.from_pretrained(toy_tiny.drafter_dir)
    d.resize_token_embeddings(576, mean_resizing=False)
    d.save_pretrained(tmp_path / "padded")
    _save_tokenizer_files(toy_tiny.drafter_dir, tmp_path / "padded")
    resolve_pair({"toy": "toy-tiny", "drafter": str(tmp_path / "padded")})


def test_drafter_without_tokenizer_is_accepted_with_a_warning(toy_tiny, tmp_path, caplog):
    shutil.copytree(toy_tiny.drafter_dir, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bare" / name).unlink()
    with caplog.at_level("WARNING"):
        resolve_pair({"toy": "toy-tiny", "drafter": str(tmp_path / "bare")})
    assert "no tokenizer files: assuming it uses pair.target's tokenizer" in caplog.text
    # Its config must agree: another EOS id is refused.
    cfg = json.loads((tmp_path / "bare" / "config.json").read_text())
    (tmp_path / "bare" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 7}))
    with pytest.raises(ConfigError, match=r"eos_token_id \[7\] vs \[0\]"):
        resolve_pair({"toy": "toy-tiny", "drafter": str(tmp_path / "bare")})


def _info(tokens, added=(), merges=None, eos="<eos>"):
    from specdistill.data.models.tokenizer_identity import TokenizerInfo

    return TokenizerInfo(
        "t", "BPE", dict(enumerate(tokens)), set(added), merges, {"eos_token": eos}
    )


def test_tokenizer_differences():
    from specdistill.data.models.tokenizer_identity import tokenizer_differences

    base = ["a", "b", "ab", "<eos>"]
    same = _info(base, merges=[("a", "b")])
    assert tokenizer_differences(same, _info(base, merges=[("a", "b")])) == ([], [])
    # Added (special) tokens past the other's end: a warning, not an error.
    errors, warnings = tokenizer_differences(same, _info([*base, "<x>"], [4], [("a", "b")]))
    assert not errors and "adds 1 tokens at ids 4..4" in warnings[0]
    # A regular token past the end, a moved id, other merges, another EOS role.
    errors, _ = tokenizer_differences(same, _info([*base, "ba"], merges=[("a", "b")]))
    assert "1 regular tokens" in errors[0]
    errors, _ = tokenizer_differences(same, _info(["b", "a", "ab", "<eos>"], merges=[("a", "b")]))
    assert "2 of 4 shared ids map to other tokens" in errors[0]
    errors, _ = tokenizer_differences(same, _info(base, merges=[("b", "a")]))
    assert "merges differ" in errors[0]
    errors, warnings = tokenizer_differences(same, _info(base, merges=[("a", "b")], eos="ab"))
    assert not errors and "eos_token" in warnings[0]


def test_integrity_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from specdistill.data.models.checkpoints import weight_problem

    save_file({"w": torch.zeros(64, 8)}, tmp_path / "model.safetensors")
    assert weight_problem(tmp_path) is None
    raw = (tmp_path / "model.safetensors").read_bytes()
    for cut, text in ((4, "not even a header length"), (20, "header alone needs")):
        (tmp_path / "model.safetensors").write_bytes(raw[:cut])
        assert text in weight_problem(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw[:-100])
    assert "100 bytes missing" in weight_problem(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw + b"xx")
    assert "is damaged" in weight_problem(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw)
    torch.save({"x": torch.zeros(100)}, tmp_path / "optimizer.bin")
    assert weight_problem(tmp_path) is None
    blob = (tmp_path / "optimizer.bin").read_bytes()
    (tmp_path / "optimizer.bin").write_bytes(blob[: len(blob) // 2])
    assert "optimizer.bin is truncated or damaged" in weight_problem(tmp_path)


# ------------------------------------------------------------------------ write faults


def enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _leftovers(root: Path) -> list[str]:
    """Temp files and folders a failed write could leave behind."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name or "-tmp" in p.name
    )


def _one_fault_line(code: int, lines: list[str], path_part: str) -> str:
    assert code == 3, lines[-5:]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-5:]
    assert (
        errors[0].startswith("error: no space left on the device writing ")
        and path_part in errors[0]
    )
    return errors[0]


GEN = ("pair=toy-tiny", "max_new_tokens=4", "dataset.limit=12", "chunk_size=4", "batch_size=4")
GEN += ("progress=false", "device=cpu")


@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_a_chunk_then_the_rerun_resumes(toy_tiny, tmp_path, monkeypatch, capsys):
    """ENOSPC half-way through chunk 3: one line naming it; no half chunk, no temp file; the
    rerun keeps chunks 1-2 and writes only chunk 3."""
    from specdistill.data.generate import shards
    from specdistill.data.generate import stage as gen

    out = tmp_path / "gen"
    real = shards.pq.write_table
    calls = []

    def full_on_third(table, where, *a, **k):
        calls.append(where)
        if len(calls) == 3:
            Path(where).write_bytes(b"PAR1 half a chunk")  # what a full disk leaves
            enospc()
        return real(table, where, *a, **k)

    monkeypatch.setattr(shards.pq, "write_table", full_on_third)
    code, lines = main_in_process(gen.main, ["gen", *GEN, f"output_dir={out}"], monkeypatch, capsys)
    line = _one_fault_line(code, lines, "chunk-00002.parquet")
    assert "needs about" in line and "free on" in line
    chunks = sorted(out.rglob("chunk-*.parquet"))
    assert [p.name for p in chunks] == ["chunk-00000.parquet", "chunk-00001.parquet"]
    assert not _leftovers(out) and not (out / "state.json").exists()
    mtimes = [p.stat().st_mtime_ns for p in chunks]
    monkeypatch.setattr(shards.pq, "write_table", real)
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="generate", overrides=[*GEN, f"output_dir={out}"])
    res = gen.run(cfg)
    assert (res.chunks_resumed, res.chunks_generated, res.samples) == (2, 1, 12) and res.merged
    assert [p.stat().st_mtime_ns for p in chunks] == mtimes


@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_the_merge_leaves_no_dataset(toy_tiny, tmp_path, monkeypatch, capsys):
    """ENOSPC while the merge saves the dataset: no state.json (not read as merged), no temp
    folder; merge_only=true then merges."""
    import datasets

    from specdistill.data.generate import merge
    from specdistill.data.generate import stage as gen

    out = tmp_path / "gen"
    real = merge.DatasetWriter.write

    def full(self, table):
        real(self, table)  # half a dataset file on disk, then the disk is full
        enospc()

    monkeypatch.setattr(merge.DatasetWriter, "write", full)
    code, lines = main_in_process(gen.main, ["gen", *GEN, f"output_dir={out}"], monkeypatch, capsys)
    _one_fault_line(code, lines, str(out))
    assert not _leftovers(out)
    assert not (out / "state.json").exists() and not (out / "result.json").exists()
    monkeypatch.setattr(merge.DatasetWriter, "write", real)
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="generate", overrides=[*GEN, f"output_dir={out}", "merge_only=true"]
        )
    assert gen.run(cfg).merged
    assert datasets.load_from_disk(str(out)).num_rows == 12


@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_a_distill_checkpoint(toy_tiny_pair, tmp_path, monkeypatch, capsys):
    """ENOSPC inside accelerate's save_state: no half step folder, no `latest`; the rerun
    with resume=true trains to the end."""
    import accelerate

    from specdistill.distill.train import stage as train
    from tests.distill.conftest import make_seqkd

    data = make_seqkd(tmp_path / "seqkd", toy_tiny_pair, n=8, comp_len=8)
    out = tmp_path / "distill"
    args = ["pair=toy-tiny", f"output_dir={out}", f"data.path={data}", "logger=none"]
    args += ["max_steps=4", "save_every=2", "eval_every=2", "eval.limit=4", "micro_batch_size=4"]
    args += ["max_seq_len=64", "device=cpu"]
    real = accelerate.Accelerator.save_state

    def full(self, output_dir=None, *a, **k):
        (Path(output_dir) / "model.safetensors").write_bytes(b"half")
        enospc()

    monkeypatch.setattr(accelerate.Accelerator, "save_state", full)
    code, lines = main_in_process(train.main, ["train", *args], monkeypatch, capsys)
    _one_fault_line(code, lines, str(out / "checkpoints" / "step-00000002"))
    ckpts = out / "checkpoints"
    assert not _leftovers(out) and not (ckpts / "latest").exists()
    assert not list(ckpts.glob("step-*"))
    monkeypatch.setattr(accelerate.Accelerator, "save_state", real)
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[*args, "resume=true"])
    res = train.run(cfg)
    assert res.steps == 4 and (ckpts / "latest").read_text().strip() == "step-00000004"


@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_an_online_checkpoint(toy_tiny, tmp_path, monkeypatch, capsys):
    """ENOSPC in the online state's torch.save: no state file, no temp file."""
    from specdistill.distill.online import stage as online

    out = tmp_path / "online"
    args = ["pair=toy-tiny", f"output_dir={out}", "logger=none", "plot=false", "device=cpu"]
    args += ["stream=[{dataset:toy-test,requests:4}]", "max_new_tokens=4", "window=2"]
    args += ["update_every=2", "update_steps=1", "save_every=2"]

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"PK\x03\x04half")
        enospc()

    monkeypatch.setattr(online.torch, "save", full)
    code, lines = main_in_process(online.main, ["online", *args], monkeypatch, capsys)
    _one_fault_line(code, lines, str(out / "online_state.pt"))
    assert not _leftovers(out) and not (out / "online_state.pt").exists()


@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_export(toy_tiny, tmp_path, monkeypatch, capsys):
    """ENOSPC in save_pretrained: nothing published, no temp folder; the size needed is named."""
    from transformers import PreTrainedModel

    from specdistill.distill.export import stage as export

    out = tmp_path / "export"

    def full(self, path, *a, **k):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"half")
        enospc()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    argv = ["export", "pair=toy-tiny", f"output_dir={out}"]
    code, lines = main_in_process(export.main, argv, monkeypatch, capsys)
    line = _one_fault_line(code, lines, str(out))
    assert "needs about" in line
    assert not _leftovers(tmp_path) and not (out / "export.json").exists()


def test_fault_classification(tmp_path, monkeypatch):
    """torch.save says 'unexpected pos' on a full disk: a fault only when the disk is full."""
    import shutil as sh

    from specdistill.data import io

    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert io.fault_errno(err, tmp_path) is None
    usage = sh.disk_usage(tmp_path)
    monkeypatch.setattr(io.shutil, "disk_usage", lambda p: usage._replace(free=100))
    assert io.fault_errno(err, tmp_path) == errno.ENOSPC
    msg = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert io.fault_errno(Exception(msg)) == errno.ENOSPC
    assert io.fault_errno(OSError(errno.ENOENT, "gone")) is None
    ro = io.describe_fault(OSError(errno.EROFS, "Read-only file system", "/ro/x"))
    assert ro.startswith("read-only file system: /ro/x") and "writable" in ro
    with (
        pytest.raises(io.WriteFault) as info,
        io.guard_write(tmp_path / "f", 10, (tmp_path / "t",)),
    ):
        (tmp_path / "t").write_text("partial")
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert not (tmp_path / "t").exists() and info.value.needed == 10
    with pytest.raises(ValueError), io.guard_write(tmp_path / "f"):
        raise ValueError("a bug stays a bug")
