"""The import contract (the root DESIGN.md, "Layout and imports"), checked over every import with `ast`.

Dependency-free on purpose: no import-linter, nothing imported from the package (a module that
fails to import, or only imports vLLM inside a function, is read all the same). Every `import`
and `from ... import` statement counts wherever it stands: module level, inside functions,
under `if TYPE_CHECKING:` or `try:`; relative imports are resolved against the importing module.

The graph's nodes are the package's modules (`pkg/__init__.py` is the node `pkg`). An import
is an edge to the module it names: `from a.b import c` points to `a.b.c` when that is a module
and to `a.b` otherwise. The parent packages Python initialises on the way (`a`, `a.b`) are not
edges (as in grimp/import-linter): every submodule would otherwise "import" its own package.

Rules:
  (a) floors: a module may import its own floor or lower ones, never a higher one
      (`data` < `decode` < `distill`);
  (b) only the orchestrator imports itself: no module outside `forbidden_target` imports it;
  (c) no cycles: every strongly connected component of the graph is reported with one cycle
      through it, written as `a -> b -> a` (a module importing itself is not a cycle);
  (d) siblings apart: no module of a package of plug-ins (validate's engines) imports another
      of its plug-ins; they share only the modules named as shared (the protocol).
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # module name inside the package
    path: Path
    line: int
    in_function: bool


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            if imp.target != imp.importer:
                out[imp.importer].add(imp.target)
        return out


def discover(roots: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for a package mapped from folders (`{"specdistill.data": data/}`)."""
    modules: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in sorted(Path(folder).rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is one of our modules, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _function_imports(tree: ast.AST) -> set[int]:
    """The ids of the import nodes that sit inside a function (or lambda) body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inside.add(id(sub))
    return inside


def parse(roots: dict[str, Path]) -> Graph:
    """Every import of every module under `roots` that lands inside the package."""
    graph = Graph(modules=discover(roots))
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        in_function = _function_imports(tree)
        # The package a relative import starts from: the module's own for `__init__.py`.
        here = module.split(".") if _is_package(path) else module.split(".")[:-1]
        seen: set[tuple[int, str]] = set()  # `from a import b, c` counts once per target
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = node.level - 1
                    if up > len(here) - 1:
                        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top")
                    base_parts = here[: len(here) - up] if up else here
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from base import x`: x is a submodule when base.x is one of ours.
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in graph.modules else base
                    for alias in node.names
                ]
            for name in names:
                target = _resolve(name, graph.modules)
                if target is None or (id(node), target) in seen:
                    continue
                seen.add((id(node), target))
                graph.imports.append(
                    Import(module, target, path, node.lineno, id(node) in in_function)
                )
    return graph


def _floor(module: str, floors: list[str]) -> int | None:
    for level, floor in enumerate(floors):
        if module == floor or module.startswith(floor + "."):
            return level
    return None


def upward_imports(graph: Graph, floors: list[str]) -> list[str]:
    """Imports of a higher floor; `floors` lists the packages bottom first."""
    found = []
    for imp in graph.imports:
        low, high = _floor(imp.importer, floors), _floor(imp.target, floors)
        if low is not None and high is not None and high > low:
            found.append(
                f"{imp.path}:{imp.line}: {imp.importer} (floor {floors[low]}) imports "
                f"{imp.target} (floor {floors[high]}, above it)"
            )
    return found


def forbidden_imports(graph: Graph, forbidden_target: str) -> list[str]:
    """Imports of `forbidden_target` (or anything in it) from outside it."""

    def inside(m: str) -> bool:
        return m == forbidden_target or m.startswith(forbidden_target + ".")

    return [
        f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target} "
        f"(only {forbidden_target} itself may import it)"
        for imp in graph.imports
        if inside(imp.target) and not inside(imp.importer)
    ]


def sibling_imports(graph: Graph, package: str, shared: set[str]) -> list[str]:
    """Imports between the modules directly in `package`, except of the package itself and of
    the `shared` modules every sibling may use."""

    def sibling(m: str) -> bool:
        return m.startswith(package + ".") and "." not in m[len(package) + 1 :]

    return [
        f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target} (a sibling in {package}; "
        f"siblings share only {sorted(shared)})"
        for imp in graph.imports
        if sibling(imp.importer)
        and sibling(imp.target)
        and imp.target not in shared
        and imp.target != imp.importer
    ]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components with a cycle only, each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    components.append(sorted(component))
    return sorted(components)


def _one_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle per strongly connected component, each `[a, b, ..., a]`."""
    edges = graph.edges()
    return [_one_cycle(c, edges) for c in strongly_connected(edges)]


def describe_cycle(cycle: list[str], graph: Graph) -> str:
    """`a -> b -> a`, with where each hop's import stands, and every module of its component
    (all of them must lose an import edge, or be merged, for the cycle to go)."""
    component = next(c for c in strongly_connected(graph.edges()) if cycle[0] in c)
    hops = [f"    component of {len(component)} modules: {', '.join(component)}"]
    for a, b in itertools.pairwise(cycle):
        where = next(i for i in graph.imports if i.importer == a and i.target == b)
        kind = "in a function" if where.in_function else "module level"
        hops.append(f"    {a} -> {b}  ({where.path}:{where.line}, {kind})")
    return " -> ".join(cycle) + "\n" + "\n".join(hops)
