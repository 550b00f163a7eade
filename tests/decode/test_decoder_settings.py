"""The typed config nodes: the `decoder` node (DecoderSettings) and the validate stage's config
(ValidateSettings) hold the defaults; the yaml files list the same values for users, and these
tests keep the two from drifting apart."""

from __future__ import annotations

import dataclasses
from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DEFAULT_GAMMA, DecoderConfig, DecoderSettings
from specdistill.decode.draft_length import DraftCosts
from specdistill.decode.validate.settings import ValidateSettings


def _yaml(name: str):
    return OmegaConf.load(str(files("specdistill.conf").joinpath(name)))


def _compose(config: str, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


def test_greedy_yaml_lists_every_setting_with_the_dataclass_default():
    node = _yaml("decoder/greedy.yaml")
    fields = {f.name for f in dataclasses.fields(DecoderSettings)}
    assert set(node) == fields  # the yaml is the users' list of every setting, no more, no less
    assert DecoderSettings.from_node(node) == DecoderSettings()
    assert node.gamma == DEFAULT_GAMMA == DecoderConfig().gamma


def test_sampling_preset_differs_from_greedy_only_in_the_sampling_spec():
    node = _compose("validate", "decoder=sampling").decoder
    assert DecoderSettings.from_node(node) == DecoderSettings(sampling=Sampling(temperature=1.0))


def test_a_missing_key_takes_the_dataclass_default():
    assert DecoderSettings.from_node({}) == DecoderSettings()
    assert DecoderSettings.from_node({"max_draft": None}).max_draft == 8


def test_validate_yaml_defaults_equal_the_dataclass_defaults():
    vs = ValidateSettings.from_cfg(_compose("validate"))
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(ValidateSettings)
        if f.default is not dataclasses.MISSING
    }
    assert {k: getattr(vs, k) for k in defaults} == defaults
    assert vs.decoder == DecoderSettings()
    assert vs.other == DecoderSettings(sampling=Sampling(temperature=1.0))  # both modes


def test_gamma_auto_is_none_parsed_once_and_resolved_by_the_caller():
    s = DecoderSettings.from_node({"gamma": "auto", "max_gamma": 6})
    assert s.gamma is None and s.max_gamma == 6 and s.gamma_or_default == DEFAULT_GAMMA
    assert s.decoder_config(16, (2,), gamma=3).gamma == 3
    with pytest.raises(ValueError, match="gamma=auto"):
        s.decoder_config(16, ())


def test_draft_costs_mapping_is_typed():
    s = DecoderSettings.from_node({"draft_costs": {"c": 0.3, "verify_per_token": 0.05}})
    assert s.draft_costs == DraftCosts(c=0.3, verify_per_token=0.05)
    assert s.decoder_config(8, ()).draft_costs == s.draft_costs


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"gamma": 0}, "decoder.gamma=0 must be an integer >= 1 or `auto`"),
        ({"gamma": "abc"}, "decoder.gamma='abc'"),
        ({"gamma": True}, "decoder.gamma=True"),
        ({"gamma": "auto", "max_gamma": 0}, "decoder.max_gamma=0 must be >= 1 for gamma=auto"),
        ({"cache": "paged"}, "decoder.cache='paged'"),
        ({"lenience": "half"}, "decoder.lenience=half"),
        ({"max_draft": 16}, "decoder.max_draft=16"),
        ({"draft_costs": {"q": 1}}, "decoder.draft_costs="),
        ({"sampling": {"temperature": -1}}, "decoder.sampling.temperature=-1"),
        ({"temperature": 0.7}, "decoder.temperature was replaced by the one sampling spec"),
        ("greedy", "decoder='greedy' must be a mapping"),
    ],
)
def test_bad_settings_name_the_field(node, message):
    with pytest.raises(ConfigError) as err:
        DecoderSettings.from_node(node)
    assert str(err.value).startswith(message)


def test_validate_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"^repeats=0 must be a positive integer"):
        ValidateSettings.from_cfg(_compose("validate", "repeats=0"))
    with pytest.raises(ConfigError, match=r"^other_sampling.temperature=0"):
        ValidateSettings.from_cfg(_compose("validate", "other_sampling.temperature=0"))
    off = ValidateSettings.from_cfg(_compose("validate", "both_modes=false"))
    assert off.other is None and off.samplings == [Sampling()]


def test_a_key_the_config_lacks_takes_the_dataclass_default_and_null_stays_null():
    cfg = _compose("validate", "seed=5")
    OmegaConf.set_struct(cfg, False)
    del cfg["seed"], cfg["plot"]
    cfg.threads = None  # null means something for threads (torch's own choice)
    vs = ValidateSettings.from_cfg(cfg)
    assert (vs.seed, vs.plot, vs.threads) == (0, True, None)
