"""One home for each name: the packages form layers, and no package imports back up them.

Every module is scanned with `ast` (imports at the top and inside functions alike, and
``importlib.import_module("...")`` with a literal name); imports under ``if TYPE_CHECKING:``
are annotations, never run, and are left out. A module's *unit* is its top-level package
(``saev_shards.writer.stats`` -> ``writer``) or, for a top-level module, the module itself;
``__main__`` modules are entry points, run and never imported, so they sit above everything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import saev_shards as ss

PACKAGE = Path(ss.__file__).parent
ENTRY = "<entry points>"

#: The layers, bottom first. A unit imports units of its own layer or below, never above;
#: within a layer the imports must not form a cycle. A new module or package gets a row here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("_compat", "humanize", "optional", "world", "fileio", "progress"),
    ("protocol",),  # every byte rule, the parsed types, the offsets
    ("codecs", "statistics", "storage", "remote"),  # the compute engines and the storages
    ("reader", "writer"),
    ("selection",),  # which tokens: one specification for the loaders and the shuffle
    ("store",),
    ("loaders", "shuffle", "convert", "dump"),
    ("saev_shards",),  # the package's own __init__: the facade that re-exports the library
    ("cli", "demo"),
    (ENTRY,),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":
        return ENTRY
    return "saev_shards" if len(parts) == 1 else parts[1]


def imported_modules(path: Path, module: str, known: set[str]) -> set[str]:
    """Every ``saev_shards`` module ``path`` (the module ``module``) imports when it runs, lazily
    or not; ``from pkg import name`` counts as importing ``pkg.name`` when that is a module and
    ``pkg`` otherwise."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(part for part in (base, node.module or "") if part)
            modules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            found.update(modules if len(modules) == len(node.names) else [target, *modules])
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return {name for name in found if name == "saev_shards" or name.startswith("saev_shards.")}


def unit_edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """``(importer unit, imported unit)`` -> the imports that make the edge (``module -> module``)."""
    files = {module_name(path): path for path in package.rglob("*.py")}
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in sorted(files.items()):
        for target in sorted(imported_modules(path, module, set(files))):
            a, b = unit_of(module), unit_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward(edges: Mapping[tuple[str, str], list[str]]) -> list[str]:
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    return [
        f"{a} (layer {level[a]}) imports {b} (layer {level[b]}): {', '.join(why)}"
        for (a, b), why in sorted(edges.items())
        if level[b] > level[a]
    ]


def test_no_cycle_between_packages():
    edges = unit_edges()
    found = cycles(edges)
    detail = [
        " <-> ".join(cycle) + ": " + "; ".join(w for (a, b), why in edges.items() if {a, b} <= set(cycle) for w in why)
        for cycle in found
    ]
    assert not found, "\n".join(detail)


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    missing = units - {unit for layer in LAYERS for unit in layer}
    assert not missing, f"add {sorted(missing)} to LAYERS in {__file__}"


def test_no_package_imports_back_up_the_layers():
    bad = upward(unit_edges())
    assert not bad, "\n".join(bad)


def test_the_shared_names_have_one_home_below_their_users():
    edges = unit_edges()
    # The staging layout and the statistics accumulator: below the reader, the writer and the store.
    for user in ("writer", "store"):
        assert (user, "statistics") in edges and (user, "protocol") in edges
    assert ("store", "writer") not in edges, edges.get(("store", "writer"))
    assert ("dump", "cli") not in edges, edges.get(("dump", "cli"))


def test_every_public_exception_lives_in_errors():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = [ast.unparse(base) for base in node.bases]
                if any(base.endswith(("Error", "Exception", "Warning")) for base in bases):
                    found.append(f"{path.relative_to(PACKAGE)}: class {node.name}({', '.join(bases)})")
    assert not found, found


# -- the scan itself -----------------------------------------------------------------------


def test_the_scan_sees_lazy_imports_and_import_module_but_not_type_checking(tmp_path: Path):
    package = tmp_path / "saev_shards" / "dump"
    package.mkdir(parents=True)
    probe = package / "probe.py"
    probe.write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..reader import Shards\n"
        "def f():\n    from ..cli import main\n    from .. import store\n"
        "    return importlib.import_module('saev_shards.shuffle')\n"
    )
    known = {"saev_shards.store", "saev_shards.cli", "saev_shards.reader"}
    found = imported_modules(probe, "saev_shards.dump.probe", known)
    assert found == {"saev_shards.cli", "saev_shards.store", "saev_shards.shuffle"}


def test_the_cycle_finder_finds_cycles_and_nothing_else():
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]) == [["a", "b", "c"]]
    assert cycles([("a", "b"), ("b", "c"), ("a", "c")]) == []


@pytest.mark.parametrize(("edge", "ok"), [(("store", "writer"), True), (("writer", "store"), False)])
def test_an_upward_edge_is_reported(edge: tuple[str, str], ok: bool):
    assert (upward({edge: ["x -> y"]}) == []) is ok
