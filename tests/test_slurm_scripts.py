"""The one sbatch script left in slurm/: the standalone Seq-KD generate array.

The pipeline submits its own steps through submitit (tests/distill/test_pipeline_slurm.py);
`slurm/generate_array.sbatch` is for generating a Seq-KD set with plain sbatch, no settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generate_array_shards_merge(tmp_path, toy_tiny):
    from datasets import load_from_disk

    out = tmp_path / "seqkd"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the script runs `python`
    args = [
        "pair=toy-tiny",
        f"output_dir={out}",
        "dataset.limit=6",
        "max_new_tokens=4",
        "batch_size=4",
        "progress=false",
    ]
    for task in (0, 1):
        env |= {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "2"}
        subprocess.run(
            ["bash", str(ROOT / "slurm" / "generate_array.sbatch"), *args],
            env=env,
            check=True,
            capture_output=True,
        )
    ds = load_from_disk(str(out))
    assert sorted(ds["prompt_index"]) == list(range(6))
