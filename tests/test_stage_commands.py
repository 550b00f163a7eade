"""Every stage's own command checks its keys before Hydra composes the config, as the pipeline does.

`python -m specdistill.decode.validate decoder.gama=3` used to end in Hydra's three-line message
suggesting `+decoder.gama=3`, and a removed key (`decoder.cpu_matmul`) in the same message
instead of the line saying it was removed. Each stage's `main` is run here in this process on
a typo and on a removed key: exit status 2, one `error:` line, and neither Hydra's main nor the
stage ran (both are replaced by functions that fail the test), so no model can have loaded.
Valid overrides (group choices, `+key=value`, `hydra.*` keys, plain keys) reach the stage's
`run` with their values. The check itself (data/stage_config.py) is the one the pipeline runs
on its `STAGE.KEY=VALUE` keys, worded for that section.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from hydra import compose
from omegaconf import OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.data.stage_config import (
    command_line_overrides,
    compose_checked,
    config_module,
    removed_message,
)
from tests.conftest import STAGE_MODULES, main_in_process

STAGES = STAGE_MODULES
DECODER_GONE = "CPU kernels are no longer chosen by timing: steps run plain F.linear"
SAMPLING_GONE = "was replaced by the one sampling spec: use"

# (stage, command-line keys, the whole error line)
TYPOS = [
    ("generate", ["max_new_tokns=4"], "no key `max_new_tokns` in the generate stage (its keys "
     "are in conf/generate.yaml); did you mean `max_new_tokens`?"),
    ("distill", ["lmbd=0.5"], "no key `lmbd` in the distill stage (its keys are in "
     "conf/distill.yaml); did you mean `lmbda`?"),
    ("online", ["decoder.gama=3"], "no key `decoder.gama` in the online stage (its keys are in "
     "conf/online.yaml); did you mean `decoder.gamma`?"),
    ("validate", ["decoder.gama=3"], "no key `decoder.gama` in the validate stage (its keys are "
     "in conf/validate.yaml); did you mean `decoder.gamma`?"),
    ("validate", ["decoder=sampling", "decoder.sampling.temprature=0.5"], "no key "
     "`decoder.sampling.temprature` in the validate stage (its keys are in conf/validate.yaml); "
     "did you mean `decoder.sampling.temperature`?"),
    ("export", ["dtyp=bf16"], "no key `dtyp` in the export stage (its keys are in "
     "conf/export.yaml); did you mean `dtype`?"),
]  # fmt: skip
# The export stage removed no settings, so it has no removed-key case.
REMOVED = [
    ("generate", ["temperature=0.7"], f"temperature {SAMPLING_GONE} sampling.temperature"),
    ("generate", ["+do_sample=true"], "do_sample was replaced by the one sampling spec: "
     "sampling.temperature=0 is greedy, > 0 samples"),
    ("distill", ["eval.temperature=0.7"], f"eval.temperature {SAMPLING_GONE} eval.sampling.temperature"),
    ("distill", ["onpolicy.top_p=0.9"], f"onpolicy.top_p {SAMPLING_GONE} onpolicy.sampling.top_p"),
    ("online", ["decoder.cpu_matmul=linear"], removed_message("decoder.cpu_matmul", DECODER_GONE)),
    ("validate", ["decoder.cpu_matmul=linear"], removed_message("decoder.cpu_matmul", DECODER_GONE)),
    ("validate", ["+decoder.cpu_matmul=linear"], removed_message("decoder.cpu_matmul", DECODER_GONE)),
    ("validate", ["prefill_once=true"], "prefill_once was removed: every decode prefills its own "
     "prompt; drop the key"),
]  # fmt: skip


def _never(*args, **kwargs):
    raise AssertionError("reached past the command-line check")


@pytest.mark.parametrize(("stage", "keys", "line"), TYPOS + REMOVED)
def test_a_typo_or_removed_key_is_one_line_before_hydra(stage, keys, line, monkeypatch, capsys):
    module = importlib.import_module(STAGES[stage])
    monkeypatch.setattr(module, "_hydra_main", _never)  # Hydra's main: never composed, nor run
    monkeypatch.setattr(module, "run", _never)
    code, err = main_in_process(module.main, [stage, "pair=toy-tiny", *keys], monkeypatch, capsys)
    assert (code, err) == (2, [f"error: {line}"])


# (stage, command-line keys beside output_dir, {dotted key: the value the stage's run gets})
VALID = [
    ("generate", ["pair=toy-tiny", "max_new_tokens=4", "+note=x", "hydra.job.chdir=false"],
     {"max_new_tokens": 4, "note": "x", "pair.toy": "toy-tiny"}),
    ("distill", ["pair=toy-tiny", "logger=none", "lmbda=0.5", "loss=jsd", "++seed=3"],
     {"lmbda": 0.5, "loss.name": "jsd", "seed": 3}),
    ("online", ["pair=toy-tiny", "decoder=sampling", "decoder.gamma=3", "logger=none"],
     {"decoder.gamma": 3, "decoder.sampling.temperature": 1.0}),
    ("validate", ["pair=toy-tiny", "decoder=sampling", "decoder.gamma=3", "+note=x"],
     {"decoder.gamma": 3, "decoder.sampling.temperature": 1.0, "note": "x"}),
    ("export", ["pair=toy-tiny", "dtype=bf16", "hydra.run.dir=."], {"dtype": "bf16"}),
]  # fmt: skip


@pytest.mark.parametrize(("stage", "keys", "values"), VALID)
def test_valid_overrides_reach_the_stage(stage, keys, values, tmp_path, monkeypatch, capsys):
    """Group choices, `+key`, `++key`, `hydra.*` and plain keys pass the check and Hydra, and the
    stage's `run` gets their values (it stops there: a stub, so nothing loads)."""
    module = importlib.import_module(STAGES[stage])
    got = {}

    def stub(cfg):
        got.update({key: OmegaConf.select(cfg, key) for key in values})
        raise ConfigError("stub run reached")

    monkeypatch.setattr(module, "run", stub)
    monkeypatch.chdir(tmp_path)
    argv = [stage, f"output_dir={tmp_path / 'out'}", *keys]
    code, err = main_in_process(module.main, argv, monkeypatch, capsys)
    assert (code, err[-1:]) == (2, ["error: stub run reached"]), err
    assert got == values


def test_the_module_command_is_one_line():
    """`python -m specdistill.decode.validate decoder.gama=3` itself: one line, exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdistill.decode.validate", "decoder.gama=3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: {TYPOS[3][2]}"]


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        (["pair=nope"], "pair=nope: conf/pair/ has no nope.yaml; use one of "),
        (["x=["], "cannot read the override 'x=[': "),
        (["+num_prompts=3"], "`+num_prompts` adds a key, but the validate stage already has "
         "`num_prompts`: set it with `num_prompts=...`"),
        (["~nope"], "Could not delete from config. 'nope' does not exist."),
    ],
)  # fmt: skip
def test_other_refusals_are_one_line(keys, line):
    with pytest.raises(ConfigError) as e:
        compose_checked("validate", keys)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_the_pipeline_wording_names_its_section():
    """The pipeline's `validate.decoder.gama=3` goes through the same check, naming the section."""
    with pytest.raises(ConfigError) as e:
        compose_checked("validate", ["decoder.gama=3"], section="validate")
    assert str(e.value) == (
        "validate: no key `decoder.gama` in the validate stage (from `validate.decoder.gama`; "
        "its keys are in conf/validate.yaml); did you mean `decoder.gamma`?"
    )
    removed = {"decoder.cpu_matmul": removed_message("decoder.cpu_matmul", DECODER_GONE)}
    with pytest.raises(ConfigError, match=r"^validate: decoder\.cpu_matmul was removed: "):
        compose_checked("validate", ["decoder.cpu_matmul=x"], removed, section="validate")


def test_commands_that_compose_nothing_of_ours_are_left_to_hydra():
    """--help, another config, a multirun's sweeps: not checked here (Hydra's main runs them)."""
    assert command_line_overrides(["a=1", "+b=2", "hydra.run.dir=x"]) == ["a=1", "+b=2", "hydra.run.dir=x"]  # fmt: skip
    for argv in (["--help"], ["-m", "lmbda=0,0.5"], ["--config-name", "other"], ["--info"]):
        assert command_line_overrides(argv) is None


def _removed_tables():
    from specdistill.data.generate.settings import removed_keys as generate
    from specdistill.decode.validate.settings import removed_keys as validate
    from specdistill.distill.online.config import removed_keys as online
    from specdistill.distill.train.settings import removed_keys as distill

    return {
        "generate": generate(),
        "distill": distill(),
        "online": online(),
        "validate": validate(),
    }


@pytest.mark.parametrize("stage", ["generate", "distill", "online", "validate"])
def test_removed_keys_are_absent_and_their_settings_refuse_them_alike(stage, tmp_path):
    """No removed key is one the stage still has (the check would refuse a valid key), and the
    stage's settings parser, given the key some other way, refuses it with the same line."""
    from specdistill.data.generate.settings import GenerateSettings
    from specdistill.decode.validate.settings import ValidateSettings
    from specdistill.distill.online.config import check_config
    from specdistill.distill.train.settings import TrainSettings

    parse = {"generate": GenerateSettings.from_cfg, "distill": TrainSettings.from_cfg,
             "online": check_config, "validate": ValidateSettings.from_cfg}[stage]  # fmt: skip
    table = _removed_tables()[stage]
    assert table
    with config_module():
        base = compose(config_name=stage, overrides=["pair=toy-tiny", f"output_dir={tmp_path}"])
        for key, line in table.items():
            assert OmegaConf.select(base, key, default="absent") == "absent", key
            cfg = compose(
                config_name=stage,
                overrides=["pair=toy-tiny", f"output_dir={tmp_path}", f"+{key}=1"],
            )
            with pytest.raises(ConfigError) as e:
                parse(cfg)
            assert str(e.value) == line, key


def test_the_pipeline_command_checks_its_own_keys(monkeypatch, capsys):
    """`specdistill stagess=[generate]`: the same one line for a key of the pipeline itself."""
    from specdistill.distill.pipeline import stage

    monkeypatch.setattr(stage, "_hydra_main", _never)
    code, err = main_in_process(
        stage.main, ["specdistill", "stagess=[generate]"], monkeypatch, capsys
    )
    assert (code, err) == (2, ["error: no key `stagess` in the pipeline stage (its keys are in "
                               "conf/pipeline.yaml); did you mean `stages`?"])  # fmt: skip
