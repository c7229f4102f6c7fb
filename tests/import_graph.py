"""Who imports whom among the project's own modules, read with `ast` (nothing is imported).

Every import statement counts, wherever it is: at module level, inside a function, under
`if TYPE_CHECKING:`. Relative imports are resolved against the importing module's package, and
`from pkg import name` counts as importing the submodule pkg.name when there is one, else pkg
itself. Importing a.b.c is an edge to a.b.c only, not to the packages a and a.b: a package's
`__init__` that imports its own submodules would otherwise close a circle with each of them.

A source root is a folder whose modules are importable by their path below it: the repository
root (capacity, infra, workloads), policy/ (the policy pack runs with its folder on sys.path) and
tests/ (pytest puts it on sys.path). A name is looked up under the importer's own root first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Module:
    name: str
    """Dotted name under its root: `workloads.client.plan`, `rules.images`, `conftest`."""
    path: Path
    """The file, relative to the repository root."""
    root: Path
    """The source root it is importable from, relative to the repository root (`.` for the top)."""

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules_under(repo: Path, roots: Mapping[Path, Iterable[str]]) -> list[Module]:
    """The modules of each root, given as {root: the top-level names of it that are the project's}:
    a package (a folder with `__init__.py`, walked whole), a module file `NAME.py`, or `*` for every
    module file directly in the root."""
    found = []
    for root, tops in roots.items():
        base = repo / root
        for top in tops:
            files = sorted(base.glob("*.py")) if top == "*" else (
                sorted((base / top).rglob("*.py")) if (base / top).is_dir() else [base / f"{top}.py"])
            for file in files:
                parts = list(file.relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                found.append(Module(".".join(parts), file.relative_to(repo), Path(root)))
    return found


def imported_names(module: Module, tree: ast.AST) -> list[tuple[str, tuple[str, ...]]]:
    """(dotted name, names taken from it) for each import in the tree, relative ones resolved."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    raise ValueError(f"{module.path}:{node.lineno}: relative import beyond the top package")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                target = ".".join(p for p in (base, node.module) if p)
            else:
                target = node.module or ""
            imports.append((target, tuple(alias.name for alias in node.names)))
    return imports


def import_graph(modules: list[Module], repo: Path) -> dict[Module, set[Module]]:
    """Each module and the project modules it imports."""
    by_root: dict[Path, dict[str, Module]] = {}
    for module in modules:
        by_root.setdefault(module.root, {})[module.name] = module
    roots_in_order = sorted(by_root, key=lambda root: root != Path("."))

    def lookup(importer: Module, name: str) -> Module | None:
        for root in (importer.root, *(r for r in roots_in_order if r != importer.root)):
            if (found := by_root[root].get(name)) is not None:
                return found
        return None

    graph: dict[Module, set[Module]] = {}
    for module in modules:
        tree = ast.parse((repo / module.path).read_text(), filename=str(module.path))
        edges = set()
        for target, names in imported_names(module, tree):
            taken = [lookup(module, f"{target}.{name}") for name in names if name != "*"]
            if taken and all(taken):
                edges.update(taken)
                continue
            edges.update(m for m in taken if m is not None)
            if (imported := lookup(module, target)) is not None:
                edges.add(imported)
        edges.discard(module)
        graph[module] = edges
    return graph


def import_circles(graph: Mapping[Module, set[Module]]) -> list[list[Module]]:
    """Each group of modules that import each other (a strongly connected component of more than one
    module), its modules sorted by path."""
    index: dict[Module, int] = {}
    low: dict[Module, int] = {}
    stack: list[Module] = []
    on_stack: set[Module] = set()
    groups: list[list[Module]] = []

    def successors(module: Module) -> Iterator[Module]:
        return iter(sorted(graph[module], key=_by_path))

    def visit(module: Module) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)

    for start in sorted(graph, key=_by_path):
        if start in index:
            continue
        # Tarjan's algorithm, without recursion: each entry is a module and its successors left.
        visit(start)
        work = [(start, successors(start))]
        while work:
            module, left = work[-1]
            for successor in left:
                if successor not in index:
                    visit(successor)
                    work.append((successor, successors(successor)))
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    group = []
                    while not group or group[-1] != module:
                        group.append(stack.pop())
                        on_stack.discard(group[-1])
                    if len(group) > 1:
                        groups.append(sorted(group, key=_by_path))
    return sorted(groups, key=lambda group: _by_path(group[0]))


def circle_through(group: list[Module], graph: Mapping[Module, set[Module]]) -> list[Module]:
    """A shortest circle of imports from the group's first module back to it, inside the group."""
    first, members = group[0], set(group)
    came_from: dict[Module, Module] = {}
    frontier = [first]
    while frontier:
        following = []
        for module in frontier:
            for successor in sorted(graph[module] & members, key=_by_path):
                if successor == first:
                    path = [module]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if successor not in came_from:
                    came_from[successor] = module
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{[str(m.path) for m in group]} is not a group of modules that import each other")


def _by_path(module: Module) -> str:
    return str(module.path)


def describe(group: list[Module], graph: Mapping[Module, set[Module]]) -> str:
    """The group's modules, and one circle of imports through them."""
    circle = " -> ".join(str(module.path) for module in circle_through(group, graph))
    return f"{', '.join(str(module.path) for module in group)} (e.g. {circle})"
