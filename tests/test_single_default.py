"""Each stage key's default is written once: in the stage's YAML (conf/), with why.

The stages' settings dataclasses hold the types, the checks and the docstrings; a field whose key
the composed stage config states has no default of its own, so the value cannot be written a
second time and drift from the YAML's. This file walks every stage's settings dataclasses (the
nested ones too, each at the node its keys sit in) against the stage's config composed by Hydra,
and names every field that has a default while the YAML states its key. Two kinds of types are
walked differently, each for a reason:

- `DecoderConfig` is also the library's decoder config (a Python caller's `DecoderConfig()`), so
  its fields keep defaults, but they are read from conf/decoder/greedy.yaml (`conf_values`): the
  file stays their one home. A subprocess imports it with every value of that file replaced by a
  marker and checks each default is the marker, so a default written in code is caught even when
  it equals the file's value.
- `Sampling`'s values are what off means (temperature 0: greedy; top_k 0, top_p 1: no filter),
  which code relies on when it builds greedy as `Sampling()`; it is not walked, and instead every
  sampling node of every stage must state all three keys, so no stage key takes a value from it.

The checkers are proven on planted duplicates, and a hand-built config without a key the
stage's YAML states is one error naming the key (no second default fills it in).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
from hydra import compose
from omegaconf import DictConfig, OmegaConf, open_dict

from specdistill.data.generate.settings import BenchSettings, GenerateSettings
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import KEYS, Sampling
from specdistill.data.stage_config import config_module
from specdistill.decode.config import DecoderConfig
from specdistill.decode.validate.engines.llamacpp import LlamaCppSettings
from specdistill.decode.validate.engines.vllm import VllmSettings
from specdistill.decode.validate.settings import ValidateSettings
from specdistill.distill.export.settings import ExportSettings
from specdistill.distill.online.config import OnlineSettings
from specdistill.distill.online.engine_settings import EngineSettings as OnlineEngine
from specdistill.distill.train.settings import TrainSettings

# (stage, settings type, the node of the stage's config whose keys it types; "" = the root)
ROOTS: list[tuple[str, type, str]] = [
    ("generate", GenerateSettings, ""),
    ("generate", BenchSettings, "bench"),
    ("distill", TrainSettings, ""),
    ("online", OnlineSettings, ""),
    ("online", OnlineEngine, ""),  # `engine` and the `llamacpp` node
    ("validate", ValidateSettings, ""),
    ("validate", LlamaCppSettings, "llamacpp"),  # held in ValidateSettings.engine_settings
    ("validate", VllmSettings, "vllm"),
    ("export", ExportSettings, ""),
]
# A field whose key is not its own name under its parent's node: "." = the parent's node itself,
# "/a.b" = that node of the stage's config, "a.b" = under the parent's node, None = no stage key
# (an experiment's key). Every other field's key is <parent node>.<field>.
PLACES: dict[tuple[type, str], str | None] = {
    (GenerateSettings, "generation"): ".",  # max_new_tokens, sampling, ... at the root
    (GenerateSettings, "engine"): "/vllm",
    (GenerateSettings, "shard_index"): "shard.index",
    (GenerateSettings, "shard_count"): "shard.count",
    (BenchSettings, "engine"): "/vllm",
    (TrainSettings, "zero_stage"): "deepspeed",  # from the deepspeed group's config
    (TrainSettings, "sweep_dir"): None,  # conf/experiment/loss_sweep.yaml's
    (OnlineSettings, "segments"): "stream",
    **{(OnlineEngine, k): f"llamacpp.{k}" for k in ("target", "drafter_type", "threads")},
    **{(OnlineEngine, k): f"llamacpp.{k}" for k in ("compare_plain", "startup_timeout")},
    (ValidateSettings, "other"): "/decoder",  # the decoder's keys, at other_sampling's spec
    (ValidateSettings, "engine_settings"): "engines",  # each chosen engine's node: ROOTS
    (VllmSettings, "engine"): ".",  # vllm.tensor_parallel_size, ... beside draft_sample_method
}
# library types whose defaults are read from one YAML file (checked by `_defaults_from_file`)
FROM_FILE: dict[type, str] = {DecoderConfig: "decoder/greedy.yaml"}
VALUE_TYPES = (Sampling,)  # the type's own meaning of off (module docstring)


class Location(typing.NamedTuple):
    owner: type
    field: str
    key: str | None  # the dotted key in the stage's config ("": its root; None: no stage key)
    has_default: bool


def _nested(hint: Any) -> list[type]:
    """The dataclasses a field's type names directly (`X`, `X | None`), not inside containers."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(hint) for t in _nested(arg)]
    return []


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def walk(cls: type, node: str) -> Iterator[Location]:
    """Every field of `cls` and of the settings types nested in it, each with its config key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        where = PLACES.get((cls, f.name), f.name)
        if where is None or where == ".":
            key = None if where is None else node
        else:
            key = where[1:] if where.startswith("/") else _join(node, where)
        yield Location(cls, f.name, key, default)
        for inner in _nested(hints[f.name]):
            if inner not in VALUE_TYPES and key is not None:
                yield from walk(inner, key)


def states(cfg: DictConfig, key: str | None) -> bool:
    """Whether the composed config states `key` (a dotted path; "" its root), resolving nothing."""
    if key is None:
        return False
    node: Any = cfg
    for part in key.split(".") if key else []:
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


@cache
def stage_config(stage: str) -> DictConfig:
    with config_module():
        return compose(config_name=stage)


def _defaults_from_file(module: str, cls: str, name: str, pythonpath: str = "") -> list[str]:
    """The fields of `module.cls` whose default is a key of conf/<name> but not read from it:
    imported in a fresh process with every value of that file replaced by a marker."""
    code = textwrap.dedent(
        f"""
        import dataclasses, importlib, json, sys
        sys.path.insert(0, {pythonpath!r})
        from specdistill.data import stage_config
        real = stage_config.conf_values
        def mark(value, path):
            if isinstance(value, dict):
                return {{k: mark(v, f"{{path}}.{{k}}") for k, v in value.items()}}
            return f"<{{path}}>"
        stage_config.conf_values = lambda name: mark(real(name), name)
        cls = getattr(importlib.import_module({module!r}), {cls!r})
        values = real({name!r})
        made = cls()
        bad = []
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            got = getattr(made, f.name)
            got = dataclasses.asdict(got) if dataclasses.is_dataclass(got) else got
            if got != mark(values[f.name], f"{name}.{{f.name}}"):
                bad.append(f.name)
        print(json.dumps(bad))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@cache
def written_in_code(cls: type) -> frozenset[str]:
    """The fields of a FROM_FILE type whose default is written in code rather than read."""
    return frozenset(_defaults_from_file(cls.__module__, cls.__name__, FROM_FILE[cls]))


def second_defaults(stage: str, cls: type, node: str, cfg: DictConfig) -> list[str]:
    """One line for each key `cfg` states whose field in `cls`'s walk has a default too."""
    out = []
    for loc in walk(cls, node):
        if not loc.has_default or not states(cfg, loc.key):
            continue
        if loc.owner in FROM_FILE and loc.field not in written_in_code(loc.owner):
            continue  # read from its one home (FROM_FILE)
        fix = (
            f"read it from conf/{FROM_FILE[loc.owner]} (conf_values)"
            if loc.owner in FROM_FILE
            else "keep the YAML's, drop the field's"
        )
        out.append(
            f"{stage}: `{loc.key}` has a default in conf/ and in "
            f"{loc.owner.__name__}.{loc.field}: {fix}"
        )
    return list(dict.fromkeys(out))  # a type walked at one node twice (validate's decoders)


@pytest.mark.parametrize(
    ("stage", "cls", "node"), ROOTS, ids=[f"{s}-{c.__name__}" for s, c, _ in ROOTS]
)
def test_no_stage_key_has_a_second_default(stage, cls, node):
    assert second_defaults(stage, cls, node, stage_config(stage)) == []


def test_the_walk_reaches_every_nested_settings_type():
    """The walk follows nested settings to their nodes; a type it missed would go unchecked."""
    reached = {(loc.owner.__name__, loc.key) for s, c, n in ROOTS for loc in walk(c, n)}
    names = {"LossSettings", "SwitchSettings", "ParallelSettings", "DataSettings"}
    names |= {"EvalSettings", "PredictSettings", "OnpolicySettings", "CheckSettings"}
    names |= {"GenerationSettings", "EngineSettings", "GGUFSettings", "DecoderConfig"}
    assert names <= {owner for owner, _ in reached}
    assert ("EngineSettings", "vllm.in_process") in reached
    assert ("GGUFSettings", "gguf.types") in reached
    assert ("GenerationSettings", "sampled_share") in reached
    assert ("DecoderConfig", "decoder.gamma") in reached


@pytest.mark.parametrize(
    ("stage", "cls", "node"), ROOTS, ids=[f"{s}-{c.__name__}" for s, c, _ in ROOTS]
)
def test_every_field_is_at_a_key_the_yaml_states(stage, cls, node):
    """Each field's default is looked for at the field's key: a field read from another key
    that PLACES does not name would be looked for where no YAML states it, and pass unseen."""
    cfg = stage_config(stage)
    unplaced = [
        f"{loc.owner.__name__}.{loc.field} at `{loc.key}`"
        for loc in walk(cls, node)
        if loc.key is not None and not states(cfg, loc.key) and loc.owner not in FROM_FILE
    ]
    assert unplaced == []


def test_the_decoder_defaults_are_read_from_their_yaml():
    assert written_in_code(DecoderConfig) == frozenset()


def test_every_sampling_node_states_the_whole_spec():
    """No stage key takes its value from Sampling's fields: every node typed as a spec says all
    (validate's `other_sampling` becomes the other decoder's spec, `modes.other_decoder`)."""
    checked = set()
    for stage, cls, node in ROOTS:
        cfg = stage_config(stage)
        spec_keys = ["other_sampling"] if cls is ValidateSettings else []
        for loc in walk(cls, node):
            if Sampling in _nested(typing.get_type_hints(loc.owner)[loc.field]):
                spec_keys.append(str(loc.key))
        for key in spec_keys:
            assert all(states(cfg, f"{key}.{k}") for k in KEYS), (stage, key)
            checked.add((stage, key))
    assert {("generate", "sampling"), ("distill", "eval.sampling")} <= checked
    assert {("distill", "onpolicy.sampling"), ("validate", "other_sampling")} <= checked
    assert {("validate", "decoder.sampling"), ("online", "decoder.sampling")} <= checked


# --- the checkers fail on planted duplicates ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PlantedSection:
    source: str
    split: str = "test"  # planted: distill.yaml states eval.split


@dataclasses.dataclass(frozen=True)
class _Planted:
    eval: _PlantedSection
    seed: int = 0  # planted: distill.yaml states seed
    sweep_dir: str | None = None  # not a key of distill.yaml: a default here is its one home


def test_a_planted_duplicate_is_named():
    lines = second_defaults("distill", _Planted, "", stage_config("distill"))
    assert lines == [
        "distill: `eval.split` has a default in conf/ and in _PlantedSection.split: keep the "
        "YAML's, drop the field's",
        "distill: `seed` has a default in conf/ and in _Planted.seed: keep the YAML's, drop "
        "the field's",
    ]


def test_a_default_written_in_code_beside_the_file_is_caught(tmp_path):
    """Even a value equal to the file's: only a default read from the file passes."""
    (tmp_path / "planted_decoder.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            from specdistill.data.stage_config import conf_values

            _FILE = conf_values("decoder/greedy.yaml")

            @dataclass(frozen=True)
            class Planted:
                gamma: int = _FILE["gamma"]
                p_min: float = 0.75  # written again
                max_new_tokens: int = 64  # not a key of the file
            """
        )
    )
    bad = _defaults_from_file("planted_decoder", "Planted", "decoder/greedy.yaml", str(tmp_path))
    assert bad == ["p_min"]


# --- a hand-built config without a key: one error naming it, no second default --------------


@pytest.mark.parametrize(
    ("stage", "key", "typed"),
    [
        ("generate", "threads", lambda c: GenerateSettings.from_cfg(c)),
        ("generate", "bench.repeats", lambda c: BenchSettings.from_cfg(c)),
        ("distill", "eval.source", lambda c: TrainSettings.from_cfg(c)),
        ("distill", "switch", lambda c: TrainSettings.from_cfg(c)),
        ("online", "guard_start", lambda c: OnlineSettings.from_cfg(c)),
        ("validate", "recommend_max_k", lambda c: ValidateSettings.from_cfg(c)),
        ("validate", "llamacpp.p_min", lambda c: LlamaCppSettings.from_node(c.llamacpp)),
        ("export", "gguf.types", lambda c: ExportSettings.from_cfg(c)),
    ],
)
def test_a_missing_key_is_one_error_naming_it(stage, key, typed):
    cfg = copy.deepcopy(stage_config(stage))
    parent, _, last = key.rpartition(".")
    with open_dict(cfg):
        del (OmegaConf.select(cfg, parent) if parent else cfg)[last]
    with pytest.raises(ConfigError) as e:
        typed(cfg)
    assert str(e.value) == (
        f"{key} is missing: its default is in the stage's YAML (conf/); compose the stage's "
        f"config from it, or set {key}"
    )
