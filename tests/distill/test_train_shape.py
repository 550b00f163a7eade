"""The shape distill/train/ keeps, measured with `ast` (nothing imported to measure): small
modules and functions, a `Trainer` whose fields name their types, and the training modes
chosen in one place (train/parts.py) as two parts the loop calls. Each rule's checker is also
shown to catch a planted violation, so the rules cannot pass vacuously."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from specdistill.distill.train import objective as objective_mod
from specdistill.distill.train import spread as spread_mod
from specdistill.distill.train.fsdp import FSDP2
from specdistill.distill.train.mapped_vocab import MappedVocab
from specdistill.distill.train.parallel_drafting import ParallelDrafting
from specdistill.distill.train.parts import choose_parts
from specdistill.distill.train.replicated import Replicated
from specdistill.distill.train.settings import TrainSettings
from specdistill.distill.train.shared_vocab import SharedVocab
from specdistill.distill.train.zero import ZeRO

TRAIN = Path(__file__).resolve().parents[2] / "distill" / "train"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
OBJECTIVES = (SharedVocab, MappedVocab, ParallelDrafting)
SPREADS = (Replicated, ZeRO, FSDP2)
# settings that pick a mode; read only where the parts are chosen or a setting is refused
MODE_SETTINGS = {"fsdp", "deepspeed", "zero_stage", "drafting"}
MODE_READERS = {"parts.py", "settings.py", "setup.py", "mapped.py"}


def _modules() -> list[Path]:
    return sorted(TRAIN.glob("*.py"))


def long_modules(sources: dict[str, str]) -> list[str]:
    return [f"{n}: {len(t.splitlines())}" for n, t in sources.items()
            if len(t.splitlines()) > MAX_MODULE_LINES]  # fmt: skip


def long_functions(sources: dict[str, str]) -> list[str]:
    out = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{name}: {node.name} ({n} lines)")
    return out


def fields_typed_any(text: str, cls: str) -> list[str]:
    """Fields of class `cls` whose annotation names `Any` anywhere."""
    node = next(
        n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls
    )
    out = []
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names = {n.id for n in ast.walk(item.annotation) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(item.annotation) if isinstance(n, ast.Attribute)}
            if isinstance(item.annotation, ast.Constant):  # a quoted annotation
                names |= set(str(item.annotation.value).replace("|", " ").split())
            if "Any" in names:
                out.append(item.target.id)
    return out


def _is_settings(node: ast.expr) -> bool:
    """`s`, or `<anything>.s` (`tr.s`, `self.s`): the stage's TrainSettings."""
    return (isinstance(node, ast.Name) and node.id == "s") or (
        isinstance(node, ast.Attribute) and node.attr == "s"
    )


def mode_reads(sources: dict[str, str]) -> list[str]:
    """Where a mode-picking setting is read outside the modules allowed to read it."""
    out = []
    for name, text in sources.items():
        if name in MODE_READERS:
            continue
        for node in ast.walk(ast.parse(text)):
            attr = isinstance(node, ast.Attribute) and node.attr in MODE_SETTINGS
            if attr and _is_settings(node.value):  # type: ignore[attr-defined]
                out.append(f"{name}:{node.lineno}: .{node.attr}")
    return out


def part_constructions(sources: dict[str, str]) -> list[str]:
    """Where a part class is built outside train/parts.py."""
    parts = {c.__name__ for c in (*OBJECTIVES, *SPREADS)}
    out = []
    for name, text in sources.items():
        if name == "parts.py":
            continue
        for node in ast.walk(ast.parse(text)):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in parts:  # type: ignore[attr-defined]
                out.append(f"{name}:{node.lineno}: {node.func.id}(...)")
    return out


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in _modules()}


def test_no_module_or_function_is_long(sources):
    assert long_modules(sources) == []
    assert long_functions(sources) == []


def test_the_trainer_names_the_type_of_every_field(sources):
    assert fields_typed_any(sources["trainer.py"], "Trainer") == []


def test_the_mode_is_chosen_in_one_place(sources):
    assert part_constructions(sources) == []
    assert mode_reads(sources) == []


def test_the_checkers_catch_planted_violations():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    planted = {
        "long.py": "\n" * MAX_MODULE_LINES + "x = 1\n",
        "step.py": f"def step(tr):\n{body}\n    if tr.s.fsdp:\n        return FSDP2()\n",
        "trainer.py": "class Trainer:\n    model: Any\n    tok: 'Tok | Any'\n    s: int\n",
    }
    assert long_modules(planted) == ["long.py: 301"]
    assert long_functions(planted) == [f"step.py: step ({MAX_FUNCTION_LINES + 3} lines)"]
    assert fields_typed_any(planted["trainer.py"], "Trainer") == ["model", "tok"]
    assert mode_reads(planted) == [f"step.py:{MAX_FUNCTION_LINES + 2}: .fsdp"]
    assert part_constructions(planted) == [f"step.py:{MAX_FUNCTION_LINES + 3}: FSDP2(...)"]


@pytest.mark.parametrize(
    ("overrides", "vocab", "objective", "spread"),
    [
        ((), "shared", SharedVocab, Replicated),
        (("drafting=parallel",), "shared", ParallelDrafting, Replicated),
        ((), "mapped", MappedVocab, Replicated),
        (("deepspeed=zero2",), "shared", SharedVocab, ZeRO),
        (("deepspeed=zero3",), "shared", SharedVocab, ZeRO),
        (("fsdp=true",), "shared", SharedVocab, FSDP2),
    ],
)  # fmt: skip
def test_choose_parts_picks_one_objective_and_one_spread(
    distill_cfg, tmp_path, overrides, vocab, objective, spread
):
    s = TrainSettings.from_cfg(distill_cfg(tmp_path, *overrides))
    parts = choose_parts(s, vocab)
    assert type(parts.objective) is objective and type(parts.spread) is spread
    if spread is ZeRO:  # ZeRO-3 partitions the head: full forwards, in lockstep
        three = s.zero_stage == 3
        assert (parts.spread.lockstep, parts.spread.head_outside) == (three, not three)


@pytest.mark.parametrize("protocol", [objective_mod.Objective, spread_mod.Spread])
def test_every_part_implements_its_protocol(distill_cfg, tmp_path, protocol):
    """Each part has every attribute of its protocol and every method with its parameters."""
    s = TrainSettings.from_cfg(distill_cfg(tmp_path))
    par = TrainSettings.from_cfg(distill_cfg(tmp_path, "drafting=parallel"))
    instances = [SharedVocab(s), MappedVocab(s), ParallelDrafting(par)]
    if protocol is spread_mod.Spread:
        instances = [Replicated(), ZeRO(2), ZeRO(3), FSDP2()]
    methods = {
        n: f for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")
    }
    fields = set(protocol.__annotations__) | {
        n for n, v in vars(protocol).items() if isinstance(v, property)
    }
    assert methods
    for part in instances:
        assert {n for n in fields if not hasattr(part, n)} == set(), type(part).__name__
        for n, f in methods.items():
            got = list(inspect.signature(getattr(part, n)).parameters)
            assert got == list(inspect.signature(f).parameters)[1:], (type(part).__name__, n)
