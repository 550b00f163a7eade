"""Hydra's submitit launcher config: a multirun goes to Slurm with `hydra/launcher=slurm`."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra")

ENV = {
    "SPECDISTILL_PARTITION": "gpu",
    "SPECDISTILL_TIME": "02:30:00",
    "SPECDISTILL_GPUS_PER_NODE": "4",
    "SPECDISTILL_SETUP": "source /opt/venv/bin/activate",
}


def _launcher(monkeypatch, env: dict[str, str]):
    for key in (*ENV, "SPECDISTILL_ACCOUNT", "SPECDISTILL_CPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="distill",
            overrides=["+experiment=loss_sweep", "hydra/launcher=slurm"],
            return_hydra_config=True,
        )
    return cfg.hydra.launcher


def test_loss_sweep_goes_to_slurm_with_the_users_settings(monkeypatch, tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    launcher = _launcher(monkeypatch, ENV)
    assert launcher._target_.endswith("SlurmLauncher")
    conf = OmegaConf.to_container(launcher, resolve=True)
    assert (conf["partition"], conf["gpus_per_node"], conf["account"]) == ("gpu", 4, None)
    script = _make_sbatch_string(
        command="python -m specdistill.distill.train",
        folder=tmp_path,
        partition=conf["partition"],
        gpus_per_node=conf["gpus_per_node"],
        time=conf["timeout_min"],
        additional_parameters=conf["additional_parameters"],
        setup=conf["setup"],
    )
    assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --gpus-per-node=4" in script
    assert "#SBATCH --time=02:30:00" in script and script.count("--time") == 1
    assert "source /opt/venv/bin/activate" in script


def test_missing_setting_names_the_variable(monkeypatch):
    launcher = _launcher(monkeypatch, {k: v for k, v in ENV.items() if k != "SPECDISTILL_TIME"})
    with pytest.raises(Exception, match="SPECDISTILL_TIME"):
        OmegaConf.to_container(launcher, resolve=True)
