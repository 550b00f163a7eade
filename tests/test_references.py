"""Every reference in the repository resolves inside it, and code carries no dates or tracker
numbers (fast: reads text files only, loads no model).

(a) References, over the .py, .yaml, .toml and .md files:
  - a relative markdown link `[text](path.md#anchor)` names an existing file (relative to the
    linking file, as a renderer reads it), and its anchor a heading of that file;
  - a mention of a repository .md path (`distill/README.md`, a bare `DESIGN.md`) names an existing
    file: in code from the repository root, in markdown from the file's folder or the root;
  - a section citation, `FILE.md, "Section"`, `FILE.md ("Section")` or `FILE.md: Section`
    (in markdown also `[text](FILE.md), "Section"`), names a heading of that file;
  - in code, a bare `DESIGN.md` or `RESULTS.md` inside a folder that has its own file of that name
    could mean either: it names the path (`distill/RESULTS.md`) or says it is the root's.
(b) No ISO date (YYYY-MM-DD) and no tracker number (`issue N`, `issue #N`, `#NNNN`) in .py and
    .yaml files: a date or an issue number says nothing to a reader of the code; the reason does.
    RESULTS.md files keep their dates (they are dated measurements).

Each rule is a pure function over (path, text), so the planted-violation tests below prove each
one fails on a bad reference, not only that the repository passes.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".yaml", ".toml", ".md"}
CODE = {".py", ".yaml", ".toml"}
SKIP_DIRS = {"outputs", "multirun", "build", "dist", "__pycache__"}  # and every .dotted folder
AMBIGUOUS_NAMES = {"DESIGN.md", "RESULTS.md"}  # README.md in code mostly names a model card's file

# A path ending in .md: optional ../ or ./ prefixes, then name segments.
_PATH = r"(?:\.\.?/)*[A-Za-z0-9_][\w.-]*(?:/[\w.-]+)*\.md"
MENTION = re.compile(rf"(?<![\w./<>$-])(?P<path>{_PATH})(?![\w/-])")
LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")
# FILE.md, "Section" | FILE.md ("Section") | FILE.md: "Section" | FILE.md: Section
CITATION = re.compile(
    rf"(?<![\w./-])(?P<path>{_PATH})(?: at the root)?(?:, \"(?P<a>[^\"]+)\"| \(\"(?P<b>[^\"]+)\"\)"
    r"|: \"(?P<c>[^\"]+)\"|: (?P<d>[A-Za-z][^)\";,\n]*?)(?=[)\";,]|\.(?:\s|$)|$))"
)
MD_CITATION = re.compile(r"\]\((?P<path>[^)\s#]+\.md)\), \"(?P<a>[^\"]+)\"")
ISO_DATE = re.compile(r"(?<!\d)20\d\d-[01]\d-[0-3]\d(?!\d)")
TRACKER = re.compile(r"\bissues? #?\d+\b|(?<!&)#\d{3,}\b", re.IGNORECASE)  # not &#123;


@dataclass(frozen=True)
class Problem:
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def repository_files(root: Path = ROOT) -> list[Path]:
    """The repository's text files this test reads (virtual environments, caches and run
    outputs left out: they are not the repository's, and pruned, not walked)."""
    out: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and "egg-info" not in d
        )
        out += [Path(folder) / f for f in sorted(files) if Path(f).suffix in SUFFIXES]
    return out


@functools.cache
def md_names(root: Path) -> frozenset[str]:
    """The names the repository's .md files have (a bare `DESIGN.md` is one of them)."""
    return frozenset(p.name for p in repository_files(root) if p.suffix == ".md")


def flatten(text: str, suffix: str) -> str:
    """The text with line breaks (and the comment markers of continued comments) turned into
    single spaces, so a citation wrapped over two lines reads as one."""
    if suffix in CODE:
        return re.sub(r"[ \t]*\n[ \t]*(?:#[ \t]*)?", " ", text)
    return re.sub(r"[ \t]*\n[ \t]*", " ", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """A markdown file's headings, as text (code spans' backticks removed), fenced blocks skipped."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(m.group(1).replace("`", ""))
    return out


def names_heading(section: str, titles: list[str]) -> bool:
    """`section` names a heading: equal to one, or the start of one up to a word's end (a citation
    may leave off a heading's trailing qualifier), ignoring case, backticks and spacing."""

    def norm(s: str) -> str:
        return " ".join(s.replace("`", "").lower().split())

    want = norm(section)
    return any(
        t.startswith(want) and not t[len(want) : len(want) + 1].isalnum() for t in map(norm, titles)
    )


def _is_repo_path(mention: str, root: Path, names: frozenset[str]) -> bool:
    """A mention is of a repository file when it is relative (../), its first folder is one of the
    repository's, or it is a bare name some repository .md file has (not `summary.md`, a run's
    output, nor `outputs/pipeline/summary.md`)."""
    parts = mention.split("/")
    if parts[0] in ("..", "."):
        return True
    if len(parts) == 1:
        return mention in names
    return (root / parts[0]).is_dir() and not parts[0].startswith(".") and parts[0] not in SKIP_DIRS


def _resolve(mention: str, source: Path, root: Path, code: bool) -> list[Path]:
    """Where a mention may point: code names paths from the root; markdown from its folder
    (as a link), or from the root as prose often does."""
    mention = mention.split("#", 1)[0]
    if code:
        return [root / mention]
    return [source.parent / mention, root / mention]


def reference_problems(source: Path, text: str, root: Path = ROOT) -> list[Problem]:
    """Every broken link, file mention, section citation and ambiguous bare name in one file."""
    rel = source.relative_to(root).as_posix()
    code = source.suffix in CODE
    names = md_names(root)
    flat = flatten(text, source.suffix)
    problems: list[Problem] = []

    if not code:
        for m in LINK.finditer(flat):
            target = m.group("target")
            if re.match(r"[a-z][a-z+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in this file (not checked)
            file_part, _, anchor = target.partition("#")
            path = (source.parent / file_part).resolve()
            if not path.exists():
                problems.append(Problem(rel, f"link target {target!r} does not exist"))
            elif anchor and path.suffix == ".md" and anchor not in map(slug, headings(path)):
                problems.append(Problem(rel, f"link {target!r}: no heading with that anchor"))

    for m in MENTION.finditer(flat):
        mention = m.group("path")
        if not _is_repo_path(mention, root, names):
            continue
        if not any(p.is_file() for p in _resolve(mention, source, root, code)):
            problems.append(Problem(rel, f"{mention} does not exist in the repository"))
        if code and "/" not in mention and mention in AMBIGUOUS_NAMES:
            floor = source.relative_to(root).parts[0]
            around = flat[max(0, m.start() - 12) : m.end() + 16]
            if (root / floor / mention).is_file() and floor != source.name and "root" not in around:
                problems.append(
                    Problem(
                        rel, f"bare {mention} could be {floor}/{mention} or the root's: name it"
                    )
                )

    citations = list(CITATION.finditer(flat)) if code else []
    if not code:
        citations += list(MD_CITATION.finditer(flat)) + list(CITATION.finditer(flat))
    for m in citations:
        mention = m.group("path")
        section = next(g for g in (m.groupdict().get(k) for k in "abcd") if g)
        if not _is_repo_path(mention, root, names):
            continue
        files = [p for p in _resolve(mention, source, root, code) if p.is_file()]
        if not files:
            continue  # reported above as a missing file
        if code or m.re is MD_CITATION or ":" not in m.group(0):
            titles = [t for f in files for t in headings(f)]
            if not names_heading(section, titles):
                problems.append(Problem(rel, f'{mention}, "{section}": no such heading there'))
    return problems


def stale_marker_problems(source: Path, text: str, root: Path = ROOT) -> list[Problem]:
    """ISO dates and tracker numbers in a .py or .yaml file."""
    if source.suffix not in (".py", ".yaml"):
        return []
    rel = source.relative_to(root).as_posix()
    problems: list[Problem] = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in ((ISO_DATE, "a date"), (TRACKER, "a tracker number")):
            for m in pattern.finditer(line):
                problems.append(Problem(f"{rel}:{number}", f"{what} ({m.group(0)!r}): say why"))
    return problems


def _all(check: Callable[[Path, str], list[Problem]], skip: Path | None = None) -> list[Problem]:
    files = [f for f in repository_files() if f != skip]
    return [p for f in files for p in check(f, f.read_text(encoding="utf-8"))]


def test_the_walk_reads_every_kind_of_file():
    rels = {f.relative_to(ROOT).as_posix() for f in repository_files()}
    for expected in ("DESIGN.md", "pyproject.toml", "conf/pipeline.yaml", "distill/losses.py"):
        assert expected in rels
    assert not any(r.startswith((".venv/", "outputs/")) for r in rels)


def test_every_reference_resolves_inside_the_repository():
    # this file's planted bad references are fixtures, not references (its dates and tracker
    # numbers are written in pieces instead, so the check below reads it too)
    problems = _all(reference_problems, skip=Path(__file__).resolve())
    assert not problems, "\n".join(map(str, problems))


def test_no_dates_or_tracker_numbers_in_code_and_configs():
    problems = _all(stale_marker_problems)
    assert not problems, "\n".join(map(str, problems))


def test_the_design_sections_code_cites_exist():
    """The sections code and messages send readers to (the import contract, the loss names)."""
    titles = headings(ROOT / "DESIGN.md")
    assert names_heading("Layout and imports", titles) and names_heading("GKD naming", titles)


# Planted violations: each rule must fail on what it exists to catch.


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A small repository: a root DESIGN.md, a floor with its own DESIGN.md and RESULTS.md."""
    (tmp_path / "distill").mkdir()
    (tmp_path / "DESIGN.md").write_text("# Design\n\n## Layout and imports\n\n## GKD naming\n")
    (tmp_path / "RESULTS.md").write_text("# results\n")
    (tmp_path / "distill" / "DESIGN.md").write_text("# distill\n\n## Parallel drafting (PARD)\n")
    (tmp_path / "distill" / "RESULTS.md").write_text("# results\n\n## Online adaptation (toy)\n")
    return tmp_path


def _problems(repo: Path, rel: str, text: str) -> list[str]:
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return [p.what for p in reference_problems(path, text, repo)]


CLEAN = [
    ("distill/a.py", '"""See the root DESIGN.md, "GKD naming", and distill/DESIGN.md."""\n'),
    ("distill/b.py", '# the contract (DESIGN.md at the root, "Layout and imports")\n'),
    ("distill/c.py", 'raise ValueError("x (see distill/DESIGN.md: Parallel drafting)")\n'),
    (
        "distill/d.py",
        '# figures: distill/RESULTS.md ("Online adaptation"); summary.md is a run\'s\n',
    ),
    ("distill/README.md", "[notes](DESIGN.md#parallel-drafting-pard), [top](../DESIGN.md)\n"),
    ("README.md", '[d](distill/DESIGN.md), "Parallel drafting"; outputs/x/report.md\n'),
    ("conf/x.yaml", '# wrapped: DESIGN.md at the root, "GKD\n# naming"\n'),
]


@pytest.mark.parametrize(("rel", "text"), CLEAN)
def test_good_references_pass(repo, rel, text):
    assert _problems(repo, rel, text) == []


PLANTED = [
    ("README.md", "[gone](docs/NOPE.md)\n", "link target 'docs/NOPE.md' does not exist"),
    ("README.md", "[a](DESIGN.md#no-such-part)\n", "no heading with that anchor"),
    ("distill/README.md", "[up](DESIGN.md#gkd-naming)\n", "no heading with that anchor"),
    ("distill/a.py", "# see distill/NOTES.md\n", "distill/NOTES.md does not exist"),
    ("conf/x.yaml", "# see ../DESIGN.md for why\n", "../DESIGN.md does not exist"),
    ("distill/a.py", '"""(the root DESIGN.md, "Import rules")"""\n', "no such heading"),
    ("distill/a.py", 'msg = "(see distill/DESIGN.md: GKD naming)"\n', "no such heading"),
    ("tests/t.py", '"""The contract (DESIGN.md ("Layers"))."""\n', "no such heading"),
    ("conf/x.yaml", '# DESIGN.md at the root, "GKD\n# conventions"\n', "no such heading"),
    ("README.md", '[d](distill/DESIGN.md), "Online"\n', "no such heading"),
    ("distill/a.py", "# figures (RESULTS.md)\n", "could be distill/RESULTS.md or the root's"),
    ("distill/a.py", '"""GKD conventions, DESIGN.md."""\n', "could be distill/DESIGN.md"),
]


@pytest.mark.parametrize(("rel", "text", "expected"), PLANTED)
def test_planted_bad_references_fail(repo, rel, text, expected):
    found = _problems(repo, rel, text)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        # written in pieces, so that this file passes its own check
        ("# built on " + "2026-" + "12-06 after a failure\n", "a date"),
        ("# a cross-tokenizer pair (issue " + "33)\n", "a tracker number"),
        ('raise ValueError("not yet (Issue #' + '71)")\n', "a tracker number"),
        ("# works around llama.cpp#" + "12345\n", "a tracker number"),
        ("# see #" + "1234\n", "a tracker number"),
    ],
)
def test_planted_dates_and_tracker_numbers_fail(tmp_path, text, bad):
    path = tmp_path / "m.py"
    found = stale_marker_problems(path, text, tmp_path)
    assert len(found) == 1 and bad in found[0].what and found[0].path == "m.py:1", found
    yaml_path = tmp_path / "c.yaml"
    assert len(stale_marker_problems(yaml_path, text, tmp_path)) == 1
    assert stale_marker_problems(tmp_path / "RESULTS.md", text, tmp_path) == []


def test_hex_colours_versions_and_plain_numbers_are_not_tracker_numbers(tmp_path):
    text = 'COLOUR = "#1f77b4"  # v0.32.0, 4096 tokens, step 100, &#' + "123; 2026 models\n"
    assert stale_marker_problems(tmp_path / "m.py", text, tmp_path) == []
