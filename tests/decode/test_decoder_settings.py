"""The typed config nodes: the `decoder` node (DecoderSettings) and the validate stage's config
(ValidateSettings). Their defaults have one home, the YAML (conf/decoder/greedy.yaml,
conf/validate.yaml; tests/test_single_default.py): these tests check that greedy.yaml lists
every decoder setting, that the presets and the composed config type as documented, and each
bad value's one line."""

from __future__ import annotations

import dataclasses
from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.config import DEFAULT_GAMMA, DecoderConfig, DecoderSettings
from specdistill.decode.validate.settings import ValidateSettings


def _yaml(name: str):
    return OmegaConf.load(str(files("specdistill.conf").joinpath(name)))


def _compose(config: str, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


def test_greedy_yaml_lists_every_decoder_setting():
    node = _yaml("decoder/greedy.yaml")
    # what a stage adds per decode (its token budget, the tokenizer's EOS ids) is not a setting
    fields = {f.name for f in dataclasses.fields(DecoderSettings)} - {
        "max_new_tokens",
        "eos_token_id",
    }
    assert set(node) == fields  # the yaml is the users' list of every setting, no more, no less
    assert DecoderSettings.from_node(node) == DecoderSettings()
    assert node.gamma == DEFAULT_GAMMA == DecoderConfig().gamma


def test_sampling_preset_differs_from_greedy_only_in_the_sampling_spec():
    node = _compose("validate", "decoder=sampling").decoder
    assert DecoderSettings.from_node(node) == DecoderSettings(sampling=Sampling(temperature=1.0))


def test_a_missing_key_takes_the_dataclass_default():
    assert DecoderSettings.from_node({}) == DecoderSettings()
    assert DecoderSettings.from_node({"max_draft": None}).max_draft == 8


def test_validate_yaml_types_both_modes_at_the_decoder_defaults():
    vs = ValidateSettings.from_cfg(_compose("validate"))
    assert (vs.num_prompts, vs.recommend_max_k, vs.engines) == (32, 8, ("ours",))
    assert vs.decoder == DecoderSettings()
    assert vs.other == DecoderSettings(sampling=Sampling(temperature=1.0))  # both modes


def test_one_config_type_with_one_set_of_defaults():
    """The stages' settings and the library's decoder config are one class, one default each:
    fixed K=4 a round, no prompt lookup (what the engines serve)."""
    assert DecoderSettings is DecoderConfig
    d = DecoderConfig()
    assert (d.gamma, d.draft_length, d.lookup) == (DEFAULT_GAMMA, "fixed", False)
    assert d.decoder_config(16, (2,), gamma=3) == d.replace(
        max_new_tokens=16, eos_token_id=(2,), gamma=3
    )


@pytest.mark.parametrize(
    "key", ["cpu_matmul", "lean_steps", "draft_floor", "probe_every", "max_gamma", "draft_costs"]
)
def test_removed_settings_say_so_in_one_line(key):
    with pytest.raises(ConfigError, match=rf"^decoder\.{key} was removed: .*; drop the key$"):
        DecoderSettings.from_node({key: 1})


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"gamma": 0}, "decoder.gamma=0 must be an integer in 1..15"),
        ({"gamma": "auto"}, "decoder.gamma=auto was removed"),
        ({"gamma": "abc"}, "decoder.gamma='abc'"),
        ({"gamma": True}, "decoder.gamma=True"),
        ({"cache": "paged"}, "decoder.cache='paged'"),
        ({"lenience": "half"}, "decoder.lenience=half"),
        ({"max_draft": 16}, "decoder.max_draft=16"),
        ({"p_min": 2}, "decoder.p_min=2"),
        ({"draft_length": "auto"}, "decoder.draft_length='auto'"),
        ({"lookup": "auto"}, "decoder.lookup='auto' must be true or false"),
        ({"sampling": {"temperature": -1}}, "decoder.sampling.temperature=-1"),
        ({"temperature": 0.7}, "decoder.temperature was removed: it was replaced by the one"),
        ({"gamm": 4}, "decoder.gamm is not a decoder setting; use one of"),
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


def test_a_key_the_config_lacks_is_named_and_null_stays_null():
    """No second default fills in a key a hand-built config lacks: validate.yaml is its home."""
    cfg = _compose("validate", "seed=5")
    OmegaConf.set_struct(cfg, False)
    cfg.threads = None  # null means something for threads (torch's own choice)
    assert ValidateSettings.from_cfg(cfg).threads is None
    del cfg["plot"]
    with pytest.raises(ConfigError, match=r"^plot is missing: its default is in the stage's YAML"):
        ValidateSettings.from_cfg(cfg)
