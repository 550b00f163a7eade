"""The dress rehearsal of each cluster preset (`pair=llama3`, `pair=qwen3`): the preset's own
pipeline, end to end on CPU, so that a user's cluster run can fail only where a GPU or the hub is
involved.

What runs is the preset's plan (conf/sizing/cluster.yaml and the pair's sizing) with exactly the
overrides in REHEARSAL below: model folders and UltraChat's name (tiny random-weight models of
the preset's own classes, vocabularies, special tokens and chat templates, and a local folder
laid out as the hub's UltraChat, all written at run time by rehearsal_models.py), the vLLM
backend (it needs a GPU), validate's dtype (random weights tie in bf16), transformers'
timing-only assisted run, and sizes. Every other value of every step is the preset's, which the
test asserts key by key, and every override is asserted to land. Then, as the cluster runs it:

- generate (each chat mode's step for qwen3) reads UltraChat's `train_sft` through the preset's
  split mapping; distill's held-out eval reads `test_sft` (no eval prompt is a training row);
- distill runs as its Slurm job does (`python -m specdistill.distill.pipeline.step` on its plan
  file) under torchrun: 2 CPU processes (gloo), FSDP2, bf16 mixed precision, packed rows, the
  stored top-32; every rank is killed after step 3, and the same command resumes from the step-2
  checkpoint and finishes;
- the local executor then skips the finished steps by fingerprint and runs validate_base,
  validate (and validate_direct for qwen3's non-thinking mode), each refusing prompts among the
  Seq-KD rows of its mode (`training_data`), export and the report.

Slow: a few minutes for both presets on 2 CPU cores (tests/README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.distill.pipeline import execute, local
from specdistill.distill.pipeline.plan import build_plan, step_file, write_plan
from tests.conftest import fake_engines
from tests.distill.rehearsal_models import PAIRS, ultrachat_folder

# What the rehearsal changes in each preset's plan, and nothing else (the same list for both).
# Paths are filled in at run time: {target}, {drafter} (rehearsal_models.py's tiny models of the
# preset's classes), {ultrachat} (its local UltraChat).
REHEARSAL = [
    "pair.target={target}",
    "pair.drafter={drafter}",
    "++generate.dataset.name={ultrachat}",  # train_sft / test_sft as on the hub, read locally
    "++distill.dataset.name={ultrachat}",
    "++generate.backend=hf",  # vLLM needs a GPU
    "++validate.dtype=fp32",  # random weights' flat logits tie in bf16; fp32 keeps lossless exact
    "++validate.hf_assisted=false",  # timing only; export's self-check runs assisted generation
    "++generate.max_new_tokens=16",  # sizes from here on
    "++distill.max_steps=4",
    "++distill.eval_every=2",
    "++distill.save_every=2",
    "++distill.eval.max_new_tokens=8",
    "++validate.num_prompts=2",
    "++validate.max_prompt_tokens=48",
    "++validate.max_new_tokens=8",
    "++validate.step_time_iters=2",
    "++validate.recommend_max_k=4",
    "++export.check.max_new_tokens=8",
]
PRESETS = ("llama3", "qwen3")
# Values of the cluster plan the rehearsal keeps (every other one is kept too, and checked).
KEPT = {
    "generate": ["topk_logprobs", "max_prompt_tokens", "dtype", "dataset.splits.train",
                 "chunk_size"],
    "distill": ["optim.optimizer.lr", "optim.warmup_steps", "max_seq_len", "micro_batch_size",
                "pack_sequences", "fsdp", "mixed_precision", "draft_vocab_train",
                "onpolicy.engine", "dataset.splits.test", "eval.split"],
    "validate": ["decoder.gamma", "dataset.source", "both_modes"],
    "export": ["dtype"],
}  # fmt: skip
ARCHITECTURES = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CRASH_SCRIPT = Path(__file__).with_name("rehearsal_crash.py")
STEP_MODULE = "specdistill.distill.pipeline.step"


def _cfg(run_dir: Path, pair: str, overrides: list[str]):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="pipeline", overrides=[f"pair={pair}", f"run_dir={run_dir}", *overrides]
        )


def _flat(node, prefix: str = "") -> dict[str, object]:
    """A step's config as dotted keys (lists kept whole)."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def _overridden(overrides: list[str]) -> dict[str, set[str]]:
    """stage -> the dotted keys the overrides set in it (`pair.*` in every stage)."""
    out: dict[str, set[str]] = {}
    for text in overrides:
        key = text.lstrip("+").partition("=")[0]
        stage, _, rest = key.partition(".")
        if stage == "pair":
            for s in ("generate", "distill", "validate", "export"):
                out.setdefault(s, set()).add(key)
        else:
            out.setdefault(stage, set()).add(rest)
    return out


def _assert_only_overrides_differ(rehearsal, preset, overrides: list[str]) -> None:
    """Every value of every step is the preset's except the keys the overrides set, and every
    override changes a value (none is lost on the way into a stage's config)."""
    assert [s.name for s in rehearsal] == [s.name for s in preset]
    keys = _overridden(overrides)
    changed_somewhere: set[str] = set()
    for ours, theirs in zip(rehearsal, preset):
        mine, cluster = _flat(ours.config), _flat(theirs.config)
        assert mine.keys() == cluster.keys(), ours.name
        changed = {k for k in mine if mine[k] != cluster[k]}
        assert changed <= keys.get(ours.stage, set()), (ours.name, changed)
        changed_somewhere |= {f"{ours.stage}.{k}" for k in changed}
    wanted = {f"{stage}.{k}" for stage, ks in keys.items() for k in ks}
    assert wanted <= changed_somewhere, wanted - changed_somewhere


def _torchrun(run_dir: Path, script: list[str], **env: str) -> subprocess.CompletedProcess:
    if shutil.which("torchrun") is None:
        pytest.fail("the `torchrun` CLI is not installed in this environment")
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", *script]
    cmd.append(str(step_file(run_dir, "distill")))
    full = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, env=full, timeout=600, capture_output=True, text=True)


def _prompts(folder: str) -> list[str]:
    import datasets

    return list(datasets.load_from_disk(folder)["prompt"])


def _checked_plan(run: Path, pair: str, paths: dict[str, Path], monkeypatch):
    """The rehearsal's plan (the pipeline config and its steps), after checking it against the
    preset's own: only the overrides differ, each lands, the kept values read as the cluster's.
    The preset's own plan is built as on its cluster, with vLLM there (a stand-in: nothing of it
    runs), since the plan refuses a vLLM generate where none is installed."""
    overrides = [o.format(**paths) for o in REHEARSAL]
    cfg = _cfg(run, pair, overrides)
    steps = build_plan(cfg)
    with monkeypatch.context() as cluster_venv:
        fake_engines(cluster_venv, run.parent / "cluster-bin")
        preset = build_plan(_cfg(run, pair, []))
    _assert_only_overrides_differ(steps, preset, overrides)
    by_name = {s.name: s for s in steps}
    cluster = {s.name: _flat(s.config) for s in preset}
    for name, keys in KEPT.items():  # spelled out: the cluster values a reader looks for
        for step, key in ((s, k) for s in by_name if s.startswith(name) for k in keys):
            assert _flat(by_name[step].config)[key] == cluster[step][key], (step, key)
    if pair == "qwen3":  # each step's chat mode: trained on both, validated in both

        def kwargs(step) -> dict | None:
            return (step.config.get("dataset") or {}).get("chat_template_kwargs")

        modes = {s.name: kwargs(s) for s in preset}
        assert {s.name: kwargs(s) for s in steps} == modes
        assert modes["generate_direct"] == modes["validate_direct"] == {"enable_thinking": False}
        assert modes["distill"] == modes["validate"] == {"enable_thinking": True}
    d = by_name["distill"].config
    assert (d["fsdp"], d["pack_sequences"], d["mixed_precision"]) == (True, True, "bf16")
    return cfg, steps


@pytest.mark.parametrize("pair", PRESETS)
def test_the_rehearsal_plan_is_the_preset_s_but_for_its_overrides(tmp_path, pair, monkeypatch):
    """The plan half of the rehearsal, in seconds (nothing is loaded): a preset change that an
    override no longer reaches, or that the rehearsal would silently replace, fails here."""
    paths = {name: tmp_path / name for name in ("target", "drafter", "ultrachat")}
    for role in ("target", "drafter"):  # folders the plan finds (it checks they are there)
        paths[role].mkdir()
        (paths[role] / "config.json").write_text("{}")
    _checked_plan(tmp_path / "run", pair, paths, monkeypatch)


@pytest.mark.slow  # the preset's whole pipeline, distill as 2 torchrun processes twice: minutes
@pytest.mark.parametrize("pair", PRESETS)
def test_dress_rehearsal(tmp_path, monkeypatch, pair):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing from the hub: every model and set is local
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    models = PAIRS[pair](tmp_path / "hub")
    chat = ultrachat_folder(tmp_path / "sets")
    paths = {"target": models.target, "drafter": models.drafter, "ultrachat": chat}
    run = tmp_path / "run"
    cfg, steps = _checked_plan(run, pair, paths, monkeypatch)
    by_name = {s.name: s for s in steps}
    gens = [s for s in steps if s.stage == "generate"]
    write_plan(steps)

    # generate: UltraChat's train_sft, through the preset's split mapping
    for g in gens:
        execute.run_step(g)
    train_prompts = [p for g in gens for p in _prompts(g.out_dir)]
    assert train_prompts and all(
        "(train_sft " in p and "(test_sft " not in p for p in train_prompts
    )
    if pair == "qwen3":  # the direct mode's prompts end in the empty reasoning block, only they
        thinking, direct = (
            _prompts(by_name[f"generate_{m}"].out_dir) for m in ("thinking", "direct")
        )
        assert all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in direct)
        assert all(p.endswith("<|im_start|>assistant\n") for p in thinking)

    # distill as its Slurm job runs it: 2 processes, FSDP2; killed after step 3, then resumed
    crashed = _torchrun(run, [str(CRASH_SCRIPT)], SPECDISTILL_TEST_CRASH_AT="3")
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    out = Path(by_name["distill"].out_dir)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert not (out / "result.json").exists()
    resumed = _torchrun(run, ["-m", STEP_MODULE])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 2" in resumed.stderr and "resumed from" in resumed.stderr
    result = read_json(out / "result.json")
    assert result["world_size"] == 2 and result["steps"] == 4
    assert [h["step"] for h in result["history"]][-2:] == [3, 4]
    eval_prompts = _prompts(str(out / "eval_continuations"))
    assert eval_prompts and all("(test_sft " in p for p in eval_prompts)  # held out
    assert not set(eval_prompts) & set(train_prompts)

    # the rest as the local executor runs it: finished steps skipped by their fingerprints
    markers = [Path(s.out_dir) / execute.DONE for s in (*gens, by_name["distill"])]
    finished = [m.stat().st_mtime_ns for m in markers]
    result = local.run(cfg)
    assert [m.stat().st_mtime_ns for m in markers] == finished  # not run again
    ran = {s.name for s in steps[:-1]}
    assert set(result.stages) == ran
    rows = {"validate_direct": "generate_direct"} if pair == "qwen3" else {}
    for s in (s for s in steps if s.stage == "validate"):
        report = read_json(s.result_path)
        assert report["lossless"] is True, s.name
        trained = by_name[rows.get(s.name, gens[0].name)].out_dir  # checked disjoint at run time
        assert report["config"]["training_data"] == trained, s.name
    exported = read_json(by_name["export"].result_path)
    assert exported["check"]["tokenizer_matches_target"] is True
    config = json.loads((Path(by_name["export"].out_dir) / "drafter" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[pair]]
    assert (run / "summary.md").is_file()
