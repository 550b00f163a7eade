"""The import contract of the root DESIGN.md ("Layout and imports"), over every import of the package.

Three floors, imports flowing down only: `distill/` may import `decode/` and `data/`, `decode/`
may import `data/`, `data/` imports neither. No stage (nor anything else outside it) imports the
orchestrator `specdistill.distill.pipeline`. No import cycles, function-level imports included.
The checker (tests/import_contract.py) reads the source with `ast`; it imports nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import import_contract as contract

ROOT = Path(__file__).resolve().parents[1]
# The umbrella package's folders (pyproject.toml's [tool.setuptools.package-dir]).
ROOTS = {f"specdistill.{name}": ROOT / name for name in ("data", "decode", "distill", "conf")}
FLOORS = ["specdistill.data", "specdistill.decode", "specdistill.distill"]  # bottom first
PIPELINE = "specdistill.distill.pipeline"
ENGINES = "specdistill.decode.validate.engines"  # one module per engine, the protocol in base
ONLINE_ENGINES = "specdistill.distill.online.engines"  # the online stage's, the same way


@pytest.fixture(scope="module")
def graph() -> contract.Graph:
    return contract.parse(ROOTS)


def test_the_checker_sees_the_whole_package(graph):
    # Every floor is read, function-level imports included (the stage runner's are).
    assert {m.split(".")[1] for m in graph.modules} == {"data", "decode", "distill", "conf"}
    assert any(i.in_function for i in graph.imports)
    assert "specdistill.distill.pipeline.stage" in graph.modules


def test_no_upward_import_between_floors(graph):
    found = contract.upward_imports(graph, FLOORS)
    assert not found, "imports of a higher floor:\n" + "\n".join(found)


def test_no_stage_imports_the_pipeline(graph):
    found = contract.forbidden_imports(graph, PIPELINE)
    assert not found, "the pipeline imported from outside it:\n" + "\n".join(found)


def test_no_import_cycles(graph):
    cycles = contract.cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        contract.describe_cycle(c, graph) for c in cycles
    )


def test_no_engine_imports_another_engines_module(graph):
    engines = {m for m in graph.modules if m.startswith(ENGINES + ".")}
    assert {f"{ENGINES}.{n}" for n in ("ours", "vllm", "llamacpp", "hf_assisted")} <= engines
    found = contract.sibling_imports(graph, ENGINES, {f"{ENGINES}.base"})
    assert not found, "an engine reaches into another:\n" + "\n".join(found)


def test_no_online_engine_imports_another_engines_module(graph):
    engines = {m for m in graph.modules if m.startswith(ONLINE_ENGINES + ".")}
    assert {f"{ONLINE_ENGINES}.{n}" for n in ("base", "vllm", "llamacpp")} <= engines
    found = contract.sibling_imports(graph, ONLINE_ENGINES, {f"{ONLINE_ENGINES}.base"})
    assert not found, "an online engine reaches into another:\n" + "\n".join(found)


def test_the_sibling_check_reports_an_engine_reaching_into_another(tmp_path):
    _write(
        tmp_path,
        {
            "decode/__init__.py": "",
            "decode/engines/__init__.py": "from pkg.decode.engines import a, b\n",
            "decode/engines/base.py": "",
            "decode/engines/a.py": "from pkg.decode.engines.base import x\n",
            "decode/engines/b.py": "def f():\n    from pkg.decode.engines import a\n",
        },
    )
    graph = contract.parse({"pkg.decode": tmp_path / "decode"})
    found = contract.sibling_imports(graph, "pkg.decode.engines", {"pkg.decode.engines.base"})
    assert len(found) == 1 and "pkg.decode.engines.b imports pkg.decode.engines.a" in found[0]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reports_planted_violations(tmp_path):
    """A synthetic package with one of each violation, each hidden the ways real code hides
    them: a cycle through a function-level relative import, an upward import inside a function,
    a stage reaching up to the pipeline with `from ... import`."""
    _write(
        tmp_path,
        {
            "data/__init__.py": "",
            "data/io.py": "def read():\n    from pkg.decode import loop\n    return loop\n",
            "decode/__init__.py": "",
            "decode/loop.py": "from pkg.decode.strategy import Strategy\n",
            "decode/strategy.py": "def f():\n    from . import loop\n    return loop\n",
            "decode/clean.py": "from pkg.data import io\n",
            "distill/__init__.py": "",
            "distill/train/__init__.py": "",
            "distill/train/stage.py": "from ..pipeline import plan\n",
            "distill/pipeline/__init__.py": "",
            "distill/pipeline/plan.py": "import pkg.distill.train.stage\n",
        },
    )
    roots = {f"pkg.{n}": tmp_path / n for n in ("data", "decode", "distill")}
    graph = contract.parse(roots)
    floors = ["pkg.data", "pkg.decode", "pkg.distill"]

    up = contract.upward_imports(graph, floors)
    assert len(up) == 1 and "pkg.data.io (floor pkg.data) imports pkg.decode.loop" in up[0]
    assert up[0].startswith(str(tmp_path / "data" / "io.py") + ":2:")

    reach = contract.forbidden_imports(graph, "pkg.distill.pipeline")
    assert (
        len(reach) == 1 and "pkg.distill.train.stage imports pkg.distill.pipeline.plan" in reach[0]
    )

    cycles = contract.cycles(graph)
    assert cycles == [
        ["pkg.decode.loop", "pkg.decode.strategy", "pkg.decode.loop"],
        ["pkg.distill.pipeline.plan", "pkg.distill.train.stage", "pkg.distill.pipeline.plan"],
    ]
    text = contract.describe_cycle(cycles[0], graph)
    assert text.startswith("pkg.decode.loop -> pkg.decode.strategy -> pkg.decode.loop")
    assert "strategy.py:2, in a function" in text

    # The real-package tests fail on these: with the violations removed, all clean.
    _write(
        tmp_path,
        {
            "data/io.py": "def read():\n    return None\n",
            "decode/strategy.py": "from pkg.data import io\n",
            "distill/train/stage.py": "from pkg.decode import loop\n",
        },
    )
    graph = contract.parse(roots)
    assert contract.upward_imports(graph, floors) == []
    assert contract.forbidden_imports(graph, "pkg.distill.pipeline") == []
    assert contract.cycles(graph) == []


def test_cycles_longer_than_two_and_self_imports(tmp_path):
    _write(
        tmp_path,
        {
            "a/__init__.py": "from pkg.a import x\n",  # a package importing its own module
            "a/x.py": "import pkg.a.y as y\n",
            "a/y.py": "from pkg.a.z import f\n",
            "a/z.py": "try:\n    from .x import g\nexcept ImportError:\n    pass\n",
            "a/me.py": "import pkg.a.me\n",  # itself: no cycle between modules
        },
    )
    graph = contract.parse({"pkg.a": tmp_path / "a"})
    assert contract.cycles(graph) == [["pkg.a.x", "pkg.a.y", "pkg.a.z", "pkg.a.x"]]
