"""DeepSpeed ZeRO-2/3 on CPU with 2 processes (gloo) train exactly like the plain 2-process path.

Every run: toy-tiny, 2 ranks x 2 micro-batches of 2 per step, lmbda=0.5 (on-policy batches,
which ZeRO-3 generates on all ranks together), 4 steps, checkpoints at steps 2 and 4. Tolerance
on per-step loss and grad norm: rel 1e-5 (the reductions sum in another order; measured
differences are ~1e-7). The first DeepSpeed run on a machine JIT-builds its CPU shared-memory
comm op (cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specdistill.data.runtime import ConfigError
from specdistill.distill.train import setup, zero

COMMON = [
    "pair=toy-tiny", "logger=none", "max_steps=4", "micro_batch_size=2", "grad_accum=2",
    "lmbda=0.5", "onpolicy.max_new_tokens=8", "max_seq_len=64", "data.seq_kd=false",
    "data.reference=true", "data.limit=32", "eval.limit=4", "eval_every=2", "save_every=2",
    "keep_checkpoints=1", "device=cpu",
]  # fmt: skip
CRASH_SCRIPT = Path(__file__).with_name("crash_at_step.py")


def _torchrun(tmp: Path, out: Path, *overrides: str, script: list[str] | None = None, **env):
    if shutil.which("torchrun") is None:
        pytest.fail("the `torchrun` CLI is not installed in this environment")
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2"]
    cmd += script or ["-m", "specdistill.distill.train"]
    cmd += [*COMMON, *overrides, f"output_dir={out}"]
    full_env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, cwd=tmp, env=full_env, timeout=900, capture_output=True, text=True)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


def _assert_same_training(plain: dict, ds: dict) -> None:
    assert plain["world_size"] == ds["world_size"] == 2
    assert [h["step"] for h in ds["history"]] == [1, 2, 3, 4]
    assert [h["tokens"] for h in ds["history"]] == [h["tokens"] for h in plain["history"]]
    for p, d in zip(plain["history"], ds["history"]):
        assert d["loss"] == pytest.approx(p["loss"], rel=1e-5), (p, d)
        assert d["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-5), (p, d)
    assert ds["alpha_after"] == pytest.approx(plain["alpha_after"], rel=1e-5)


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("plain")
    _ok(_torchrun(tmp, tmp / "out"))
    return tmp / "out"


def _assert_final_is_consolidated(out: Path) -> None:
    """final/ is a whole checkpoint that from_pretrained loads, holding exactly the fp32
    master weights in the last ZeRO checkpoint's shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out / "final")).state_dict()
    masters = get_fp32_state_dict_from_zero_checkpoint(
        str(out / "checkpoints" / "step-00000004"), tag="pytorch_model"
    )
    for k, v in load_file(str(out / "final" / "model.safetensors")).items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0, msg=k)
        torch.testing.assert_close(masters[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow  # plain + ZeRO-2 torchrun launches on CPU
def test_zero2_trains_step_for_step_like_the_plain_path(tmp_path, plain_run):
    """ZeRO-2 with the masked head and the chunked loss through the engine's forward
    (train/logits.final_hidden) against the plain path's masked logits."""
    out = tmp_path / "out"
    _ok(_torchrun(tmp_path, out, "deepspeed=zero2", "chunked_loss=true"))
    _assert_same_training(_result(plain_run), _result(out))
    _assert_same_weights(plain_run / "final", out / "final")
    _assert_final_is_consolidated(out)


@pytest.mark.slow  # 2 torchrun launches on CPU
def test_zero3_offload_killed_and_resumed_trains_like_the_plain_path(tmp_path, plain_run):
    """ZeRO-3 with parameters and optimizer offloaded to the CPU, on-policy batches generated
    by both ranks together, killed after step 3 and resumed from the step-2 ZeRO checkpoint:
    step for step the plain uninterrupted run, down to best/ and final/."""
    out = tmp_path / "out"
    ds = ("deepspeed=zero3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu")
    crashed = _torchrun(
        tmp_path, out, *ds, script=[str(CRASH_SCRIPT)], SPECDISTILL_TEST_CRASH_AT="3"
    )
    assert crashed.returncode != 0 and not (out / "result.json").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    _ok(_torchrun(tmp_path, out, *ds, "resume=true"))
    _assert_same_training(_result(plain_run), _result(out))
    _assert_same_weights(plain_run / "final", out / "final")
    _assert_same_weights(plain_run / "best", out / "best")
    _assert_final_is_consolidated(out)


def _cfg(distill_cfg, tmp_path, *overrides):
    return distill_cfg(tmp_path / "run", *overrides)


def test_ds_config_is_filled_from_the_run(distill_cfg, tmp_path):
    cfg = _cfg(
        distill_cfg, tmp_path, "deepspeed=zero3", "micro_batch_size=3", "grad_accum=5",
        "optim.max_grad_norm=0.5", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu",
    )  # fmt: skip
    ds = zero.ds_config(cfg, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False  # the stage's AdamW + LR schedule stay
    plain = zero.ds_config(
        _cfg(distill_cfg, tmp_path, "deepspeed=zero2", "optim.max_grad_norm=null"), 1
    )
    assert (
        plain["gradient_clipping"] == 0.0 and "offload_optimizer" not in plain["zero_optimization"]
    )
    assert "zero_force_ds_cpu_optimizer" not in plain


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["deepspeed=zero2", "deepspeed.offload_param=cpu"], "deepspeed.offload_param"),
        (["deepspeed=zero3", "deepspeed.offload_optimizer=nvme"], "deepspeed.offload_optimizer"),
        (["deepspeed=zero2", "deepspeed.config.zero_optimization.stage=1"], "stage"),
        (
            ["deepspeed=zero2", "+deepspeed.config.optimizer.type=Adam"],
            "deepspeed.config.optimizer",
        ),
        (["deepspeed=zero2", "mixed_precision=fp16"], "mixed_precision"),
    ],
)
def test_bad_deepspeed_settings_name_the_field(distill_cfg, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        setup.check_config(_cfg(distill_cfg, tmp_path, *overrides))


def _fake_accelerator(index: int, processes: int):
    from accelerate.utils import DistributedType

    return SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, process_index=index, num_processes=processes
    )


def test_ranks_that_disagree_with_the_launcher_are_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    zero.check_ranks(_fake_accelerator(1, 2), rank=1, world=2)  # agrees: no error
    # what accelerate 1.15 reported on CPU without a named backend: every rank alone
    with pytest.raises(ConfigError, match="launcher started rank 1 of 2"):
        zero.check_ranks(_fake_accelerator(0, 1), rank=1, world=2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="deepspeed"):
        zero.check_ranks(_fake_accelerator(1, 2), rank=1, world=2)
