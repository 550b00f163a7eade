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
