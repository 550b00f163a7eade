"""2 processes x 1 micro-batch == 1 process x 2 micro-batches (same global window); the two
processes take the masked head and the chunked loss through DDP's forward
(train/logits.final_hidden), the one process its masked logits.

accelerate 1.15's `accelerate launch --num_processes 2 --cpu` starts a single process unless an
MPI hostfile is given (its CPU multi-process path is mpirun), so the two CPU processes are
started with torchrun, which accelerate picks up (WORLD_SIZE/RANK env, gloo backend).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

COMMON = [
    "pair=toy-tiny", "logger=none", "max_steps=4", "micro_batch_size=4", "max_seq_len=64",
    "data.seq_kd=false", "data.reference=true", "data.limit=32", "eval.limit=4",
    "eval_every=4", "save_every=4", "keep_checkpoints=1", "device=cpu",
]  # fmt: skip


@pytest.mark.slow  # two accelerate launches on CPU: minutes on shared cores
def test_two_processes_match_one_process_with_twice_the_accumulation(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.fail("the `torchrun` CLI is not installed in this environment")
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(
        [sys.executable, "-m", "specdistill.distill.train", *COMMON, "grad_accum=2",
         f"output_dir={one}"], check=True, env=env, timeout=900,
    )  # fmt: skip
    subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2", "-m",
         "specdistill.distill.train", *COMMON, "grad_accum=1", "chunked_loss=true",
         f"output_dir={two}"], check=True, env=env, timeout=900,
    )  # fmt: skip
    r1 = json.loads((one / "result.json").read_text())
    r2 = json.loads((two / "result.json").read_text())
    assert r1["world_size"] == 1 and r2["world_size"] == 2
    l1 = [h["loss"] for h in r1["history"]]
    l2 = [h["loss"] for h in r2["history"]]
    assert len(l1) == len(l2) == 4
    for a, b in zip(l1, l2):  # float tolerance: the all-reduce sums in another order
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    assert [h["tokens"] for h in r1["history"]] == [h["tokens"] for h in r2["history"]]
    assert r2["alpha_after"] == pytest.approx(r1["alpha_after"], rel=1e-4)
    ckpts = sorted(p.name for p in (two / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-00000004"]
    assert (two / "checkpoints" / "step-00000004" / "model.safetensors").exists()
