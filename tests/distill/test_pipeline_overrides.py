"""Stage overrides survive the trip through Hydra's override grammar."""

from __future__ import annotations

from specdistill.distill.compose import flatten_overrides, format_override


def test_format_override_scalars_and_quoting():
    assert format_override("a", None) == "a=null"
    assert format_override("a", True) == "a=true"
    assert format_override("a", 3) == "a=3"
    assert format_override("a", 0.5) == "a=0.5"
    assert format_override("a", "toy-tiny") == "a=toy-tiny"
    assert format_override("a", "/tmp/x y/it's") == "a='/tmp/x y/it\\'s'"
    assert format_override("a", [1, "b"]) == "a=[1,b]"


def test_flatten_nested():
    got = flatten_overrides({"max_new_tokens": 8, "dataset": {"limit": 4, "split": "test"}})
    assert got == ["max_new_tokens=8", "dataset.limit=4", "dataset.split=test"]


def test_overrides_parse_back_in_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = {"p": "/tmp/x y/it's", "n": 3, "f": 0.25, "b": False, "z": None, "l": [1, "b"]}
    parsed = OverridesParser.create().parse_overrides(flatten_overrides(values))
    assert {o.key_or_group: o.value() for o in parsed} == values


def _pipeline(*overrides: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="pipeline", overrides=["pair=toy-tiny", *overrides])


def test_typed_values_merge_after_groups_and_the_users_keys_win():
    """StageOverrides: the group choice is composed by Hydra, the typed values merged into the
    composed node as values (a path with a quote stays the same string, no grammar), and the
    user's `STAGE.KEY=VALUE` keys win over both; a user's group choice is not re-applied as a
    value (it picked the yaml the typed values then land in)."""
    from specdistill.distill.compose import StageOverrides, compose_stage

    cfg = _pipeline("++validate.decoder.sampling.top_p=0.5", "++validate.seed=7")
    odd = "/tmp/x y/it's {a}"
    sv = StageOverrides(
        ("decoder=greedy",),
        {"decoder.sampling": {"temperature": 0.7, "top_k": 3, "top_p": 0.9}, "output_dir": odd,
         "seed": 1, "decoder.drafting": "parallel"},
    )  # fmt: skip
    val = compose_stage("validate", cfg, sv)
    assert val.output_dir == odd and val.decoder.drafting == "parallel"
    assert (val.decoder.sampling.temperature, val.decoder.sampling.top_k) == (0.7, 3)
    assert val.decoder.sampling.top_p == 0.5 and val.seed == 7  # the user's keys
    plain = compose_stage("validate", _pipeline(), sv)
    assert plain.decoder.sampling.top_p == 0.9 and plain.seed == 1
    picked = compose_stage("validate", _pipeline("++validate.decoder=sampling"), sv)
    assert picked.decoder.sampling.temperature == 0.7  # typed values land in the user's pick
    later = sv + StageOverrides(values={"decoder.drafting": "autoregressive"})
    assert compose_stage("validate", _pipeline(), later).decoder.drafting == "autoregressive"
