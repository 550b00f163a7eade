"""The package list in pyproject.toml is written out by hand (setuptools `package-dir` maps the
folders under `specdistill`): a subpackage missing from it works in an editable install and is
silently absent from a built wheel. This holds the list to the folders that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's); 3.10 has no TOML reader

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "data": "specdistill.data",
    "decode": "specdistill.decode",
    "distill": "specdistill.distill",
}


def _packages_on_disk() -> set[str]:
    found = {"specdistill.conf"}
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    return found


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "listed in pyproject.toml but not a package folder"


def test_the_data_copies_are_package_data():
    """`local:` paths resolve into data/sets (data/local_data.py): a file there that the
    package-data globs miss is in a clone but silently absent from an installed wheel."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["specdistill.data"]
    shipped = {p for g in globs for p in (ROOT / "data").glob(g) if p.is_file()}
    on_disk = {p for p in (ROOT / "data" / "sets").rglob("*") if p.is_file()}
    assert on_disk, "data/sets holds no files"
    assert on_disk - shipped == set(), (
        "add these to [tool.setuptools.package-data] specdistill.data"
    )
    assert (ROOT / "data" / "sets" / "README.md") in shipped  # the licenses and sources
