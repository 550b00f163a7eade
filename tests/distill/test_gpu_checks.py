"""The GPU part's prepared run (distill/bench/gpu_checks.py) on a CPU: every command it gives the
stages is one they take, and its table reads their results. The GPU's figures come only where a
device is lent; this keeps the script from rotting where none is."""

from __future__ import annotations

import json

import pytest

from specdistill.distill.bench import gpu_checks


@pytest.mark.slow
def test_the_gpu_checks_run_every_section_on_a_cpu(tmp_path, toy_tiny):
    out = tmp_path / "gpu"
    code = gpu_checks.main(["--out", str(out), "--device", "cpu", "--dtype", "fp32",
                            "--sections", "toy_tau", "distill", "--prompts", "4",
                            "--steps", "2"])  # fmt: skip
    results = json.loads((out / "gpu_checks.json").read_text())
    runs = {**results["toy_tau"], **results["distill"]}
    assert code == 0, {n: r["tail"] for n, r in runs.items() if r["rc"] != 0}
    taus = [r["tau"] for r in results["toy_tau"].values()]
    assert len(taus) == 2 and taus[0] == taus[1] and 1.0 <= taus[0] <= 5.0  # same kernels
    for name in ("bf16", "packed", "fsdp2_one_process"):
        assert results["distill"][name]["steps"] == 2
    table = (out / "gpu_checks.md").read_text()
    assert table.count("| ok |") == 6 and "failed" not in table


def test_cuda_without_a_device_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_checks.main(["--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --device cuda but torch sees no CUDA device")
    assert not any(tmp_path.iterdir())
