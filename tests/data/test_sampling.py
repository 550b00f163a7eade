"""The one sampling spec (data/sampling.py): its parser, its errors, and that it is the only one."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("node", "want"),
    [
        ({}, Sampling()),
        ({"temperature": 0}, Sampling()),
        ({"temperature": 1, "top_k": 40, "top_p": 0.9}, Sampling(1.0, 40, 0.9)),
        ({"temperature": 0.7, "top_k": 40.0, "top_p": 1}, Sampling(0.7, 40, 1.0)),
        ({"temperature": None, "top_k": None, "top_p": None}, Sampling()),
        (OmegaConf.create({"temperature": 0.7, "top_k": 0, "top_p": 0.9}), Sampling(0.7, 0, 0.9)),
    ],
)
def test_from_node_reads_the_three_keys(node, want):
    got = Sampling.from_node(node, "decoder.sampling")
    assert got == want and isinstance(got.temperature, float) and isinstance(got.top_k, int)
    assert got.greedy == (want.temperature == 0)
    assert Sampling.from_node(got.as_dict(), "x") == got  # round trip


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"temperature": -0.5}, "eval.sampling.temperature=-0.5 must be a number >= 0"),
        ({"temperature": "hot"}, "eval.sampling.temperature='hot' must be a number >= 0"),
        ({"temperature": float("nan")}, "eval.sampling.temperature=nan"),
        ({"temperature": True}, "eval.sampling.temperature=True"),
        ({"top_k": -1}, "eval.sampling.top_k=-1 must be an integer >= 0"),
        ({"top_k": 2.5}, "eval.sampling.top_k=2.5 must be an integer >= 0"),
        ({"top_p": 0}, "eval.sampling.top_p=0.0 must lie in (0, 1]"),
        ({"top_p": 1.5}, "eval.sampling.top_p=1.5 must lie in (0, 1]"),
        ({"temp": 1.0}, "eval.sampling has unknown key(s) temp: use temperature, top_k, top_p"),
        (0.7, "eval.sampling=0.7 must be a mapping {temperature, top_k, top_p}"),
        (None, "eval.sampling=None must be a mapping"),
    ],
)
def test_bad_values_are_one_config_error_naming_the_field(node, message):
    with pytest.raises(ConfigError) as err:
        Sampling.from_node(node, "eval.sampling")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_check_names_the_field_of_a_built_spec():
    assert Sampling(1.0, 5, 0.5).check("x") == Sampling(1.0, 5, 0.5)
    with pytest.raises(ConfigError, match=r"^onpolicy\.sampling\.top_p=2"):
        Sampling(1.0, 0, 2).check("onpolicy.sampling")


def test_there_is_one_sampling_class():
    """decode/acceptance.py and the generate stage use the ground floor's class, not their own."""
    from specdistill.data.generate import batched
    from specdistill.decode import acceptance

    assert acceptance.Sampling is Sampling and batched.Sampling is Sampling
    settings = batched.GenerationSettings(
        max_new_tokens=1, sampling=Sampling(), num_samples=1, seed=0, sampled_share=1.0
    )
    assert not settings.do_sample  # derived from the spec: temperature 0 is greedy
    defs = [
        str(p.relative_to(ROOT))
        for folder in ("data", "decode", "distill")
        for p in (ROOT / folder).rglob("*.py")
        if "class Sampling" in p.read_text()
    ]
    assert defs == ["data/sampling.py"]


@pytest.mark.parametrize(
    ("parent", "field", "message"),
    [
        ({"temperature": 0.7, "sampling": {}}, "decoder.sampling", "decoder.temperature was "
         "replaced by the one sampling spec: use decoder.sampling.temperature"),
        ({"top_p": 0.9, "sampling": {}}, "serving.sampling", "serving.top_p was replaced"),
        ({"do_sample": True, "sampling": {}}, "sampling", "do_sample was replaced by the one "
         "sampling spec: sampling.temperature=0 is greedy, > 0 samples"),
        ({}, "eval.sampling", "eval.sampling=None must be a mapping"),
    ],
)  # fmt: skip
def test_from_parent_refuses_the_per_key_spelling_it_replaced(parent, field, message):
    """`+decoder.temperature=0.7` (what Hydra suggests for an unknown key) is named, not ignored."""
    with pytest.raises(ConfigError) as err:
        Sampling.from_parent(parent, field)
    assert str(err.value).startswith(message)
    assert Sampling.from_parent({"sampling": {"top_k": 3}}, field) == Sampling(top_k=3)
