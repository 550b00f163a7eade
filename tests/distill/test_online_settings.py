"""The online stage's config typed once (OnlineSettings): conf/online.yaml holds each key's
default (its one home: tests/test_single_default.py), and the typed values reach what the stage
reads."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.decode.config import DecoderSettings
from specdistill.distill.online.config import (
    GATE_GREEDY,
    GATE_SAMPLING,
    OnlineSettings,
    check_config,
)


def _cfg(*overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="online", overrides=list(overrides))


def test_online_yaml_types_the_stream_and_a_fixed_gamma_decoder():
    s = OnlineSettings.from_cfg(_cfg())
    assert (s.topk, s.gate_agreement, s.resume) == ("auto", "auto", "auto")
    assert s.decoder == DecoderSettings(draft_length="fixed")
    assert [g.label for g in s.segments] == ["toy-test", "stdlib-mail", "stdlib-numeric"]


def test_typed_values_and_the_gate_by_serving_mode():
    s = check_config(_cfg("decoder=sampling", "gate_agreement=0.5", "gate_relaxed=0", "topk=8"))
    assert (s.gate_agreement, s.gate_relaxed, s.topk) == (0.5, 0.0, 8)
    assert s.gate == 0.5 and s.decoder.sampling.temperature == 1.0
    assert OnlineSettings.from_cfg(_cfg()).gate == GATE_GREEDY
    assert OnlineSettings.from_cfg(_cfg("decoder=sampling")).gate == GATE_SAMPLING
    assert OnlineSettings.from_cfg(_cfg("gate_agreement=null")).gate is None
    # fixed-gamma rounds online, in both serving modes
    assert OnlineSettings.from_cfg(_cfg()).decoder.draft_length == "fixed"
    assert OnlineSettings.from_cfg(_cfg("decoder=sampling")).decoder.draft_length == "fixed"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("window=0", "window=0 must be a positive integer"),
        ("decoder.gamma=auto", "decoder.gamma=auto was removed"),
        ("decoder.draft_length=confidence", "decoder.draft_length=confidence is not supported"),
        ("decoder.draft_length=heuristic", "decoder.draft_length=heuristic is not supported"),
        ("decoder.drafting=parallel", "decoder.drafting=parallel is not supported online"),
        ("+decoder.cpu_matmul=linear", "decoder.cpu_matmul was removed"),
        ("decoder.cache=paged", "decoder.cache='paged'"),
        ("gate_agreement=2", "gate_agreement=2 must be a cosine"),
    ],
)
def test_bad_settings_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        OnlineSettings.from_cfg(_cfg(override))
    assert str(err.value).startswith(message)
