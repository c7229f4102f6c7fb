"""The plan of the code holds: no two modules import each other, nothing of the product imports the
benchmarks or the rehearsals, and each room (a folder of the README's Layout table) imports only
the rooms its row allows. Read with `ast` (tests/import_graph.py): every import statement counts,
at module level, inside functions and under `if TYPE_CHECKING:`."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from import_graph import Module, describe, import_circles, import_graph, modules_under

PROJECT_SOURCES = {
    Path("."): ("capacity", "infra", "workloads", "__main__"),
    Path("policy"): ("*", "rules"),
    Path("tests"): ("*",),
}
"""Each source root and the project's modules in it (tests/import_graph.py, modules_under)."""
NOT_THE_PRODUCT = ("workloads/bench/", "workloads/rehearse/", "tests/")
"""Where the benchmarks, the rehearsals and the tests live: nothing else may import the first two."""


@pytest.fixture(scope="module")
def graph(repo_root: Path) -> dict[Module, set[Module]]:
    return import_graph(modules_under(repo_root, PROJECT_SOURCES), repo_root)


def test_no_two_modules_import_each_other(graph):
    groups = import_circles(graph)
    assert not groups, "modules that import each other:\n  " + "\n  ".join(describe(g, graph) for g in groups)


def test_nothing_of_the_product_imports_the_benchmarks_or_the_rehearsals(graph):
    wrong = sorted(f"{module.path} imports {imported.path}" for module, imports in graph.items()
                   if not str(module.path).startswith(NOT_THE_PRODUCT) for imported in imports
                   if str(imported.path).startswith(("workloads/bench/", "workloads/rehearse/")))
    assert not wrong, "\n".join(wrong)


def layout_rooms(readme: str) -> dict[str, frozenset[str] | None]:
    """The README's Layout table: each room's path and what it may import (None: anything): rooms,
    or single modules of a room where only that one is needed."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rooms: dict[str, frozenset[str] | None] = {}
    for row in re.findall(r"^\| `([^`|]+)` \|[^|\n]*\|([^|\n]*)\|$", section, flags=re.M):
        path, may_import = row
        rooms[path] = None if may_import.strip() == "anything" else frozenset(re.findall(r"`([^`]+)`", may_import))
    return rooms


def room_of(path: Path, rooms) -> str:
    """The room a file is in: the longest path of the table that holds it."""
    text = path.as_posix()
    holding = [room for room in rooms if text == room or (room.endswith("/") and text.startswith(room))]
    if not holding:
        raise AssertionError(f"{text} is in no room of the README's Layout table: add its row")
    return max(holding, key=len)


def test_each_room_imports_only_the_rooms_its_layout_row_allows(graph, repo_root):
    rooms = layout_rooms((repo_root / "README.md").read_text())
    assert len(rooms) >= 10, f"the Layout table was not read: {rooms}"
    unknown = {allowed for allows in rooms.values() if allows for allowed in allows
               if allowed not in rooms and not (repo_root / allowed).is_file()}
    assert not unknown, f"the Layout table allows what is neither a room of it nor a file: {sorted(unknown)}"
    wrong = set()
    for module, imports in graph.items():
        room = room_of(module.path, rooms)
        allowed = rooms[room]
        for imported in imports:
            other = room_of(imported.path, rooms)
            if allowed is not None and other != room and not {other, imported.path.as_posix()} & allowed:
                wrong.add(f"{module.path} ({room}) imports {imported.path} ({other})")
    assert not wrong, "imports the README's Layout table does not allow:\n" + "\n".join(sorted(wrong))


# --- the reading itself, on small trees -------------------------------------------------------------


def tree(tmp_path: Path, files: dict[str, str]) -> dict[Module, set[Module]]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return import_graph(modules_under(tmp_path, {Path("."): ("pkg",)}), tmp_path)


def paths(graph) -> dict[str, set[str]]:
    return {str(m.path): {str(i.path) for i in imports} for m, imports in graph.items()}


def circle_paths(graph) -> list[list[str]]:
    return [[str(m.path) for m in group] for group in import_circles(graph)]


def test_an_import_inside_a_function_or_under_type_checking_counts(tmp_path):
    graph = tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "def f():\n    import pkg.a\n",
    })
    assert circle_paths(graph) == [["pkg/a.py", "pkg/b.py"]]


def test_relative_imports_resolve_against_the_package(tmp_path):
    graph = tree(tmp_path, {
        "pkg/__init__.py": "from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..d import x\nfrom . import e\n",
        "pkg/sub/e.py": "",
        "pkg/d.py": "from .sub.c import y\n",
    })
    assert paths(graph)["pkg/sub/c.py"] == {"pkg/d.py", "pkg/sub/e.py"}
    assert paths(graph)["pkg/__init__.py"] == {"pkg/sub/c.py"}
    assert circle_paths(graph) == [["pkg/d.py", "pkg/sub/c.py"]]


def test_from_a_package_import_a_submodule_imports_that_submodule_not_the_package(tmp_path):
    graph = tree(tmp_path, {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "from pkg import b, NAME\n",
        "pkg/b.py": "import os\n",
    })
    assert paths(graph) == {"pkg/__init__.py": {"pkg/a.py"}, "pkg/a.py": {"pkg/b.py", "pkg/__init__.py"},
                            "pkg/b.py": set()}
    # A package's __init__ that imports its submodules makes no circle with a submodule that
    # imports a sibling: importing pkg.b is not importing pkg. Taking a name from the package is.
    assert circle_paths(graph) == [["pkg/__init__.py", "pkg/a.py"]]


def test_a_circle_of_three_is_one_group_and_shown_as_a_circle(tmp_path):
    graph = tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "import pkg.c\n",
        "pkg/c.py": "from pkg.a import x\n",
        "pkg/d.py": "import pkg.a\n",
    })
    groups = import_circles(graph)
    assert circle_paths(graph) == [["pkg/a.py", "pkg/b.py", "pkg/c.py"]]
    assert describe(groups[0], graph).endswith("(e.g. pkg/a.py -> pkg/b.py -> pkg/c.py -> pkg/a.py)")


def test_a_room_is_the_longest_row_that_holds_the_file():
    rooms = {"workloads/": frozenset(), "workloads/train/": frozenset(), "__main__.py": frozenset()}
    assert room_of(Path("workloads/train/loop.py"), rooms) == "workloads/train/"
    assert room_of(Path("workloads/context.py"), rooms) == "workloads/"
    assert room_of(Path("__main__.py"), rooms) == "__main__.py"
    with pytest.raises(AssertionError, match="in no room"):
        room_of(Path("infra/cluster.py"), rooms)
