"""The shape of the code, checked by an `ast` scan (the rooms a newcomer walks, STYLE.md):

* at most `MAX_TOP_LEVEL` modules at the top level of ``saev_shards/`` (the rest live in
  the packages of the layers: tests/unit/test_import_graph.py);
* no module over `MAX_MODULE_LINES` lines, no class over `MAX_CLASS_LINES`, no function
  over `MAX_FUNCTION_LINES` lines or `MAX_PARAMETERS` parameters (``self`` and ``cls`` not
  counted, ``*args`` and ``**keywords`` one each), but for the exemptions below, each with
  its reason. Options dataclasses hold what would be long signatures: their fields are no
  function's parameters (`ShuffleOptions`, `ConvertOptions`, `CopyOptions`);
* no private name (``_name``) used across packages: neither imported (``from ..reader.x
  import _y``, or a private module of another package) nor reached as an attribute
  (``shards._fd(k)`` in the loaders) where only another package defines it;
* every package's ``__init__`` re-exports only: a docstring, imports, ``__all__``;
* no docstring or comment names the project's tracker (``issue 12``) or its source
  documents (``seed 004``): say what the thing is instead ("saev's run layout").

The rules cover the library, ``saev_shards/``. The benchmarks (``benchmarks/``) follow the
last two. Their sizes and private names are not checked: each suite is one script whose
measuring functions are long on purpose (a table's setup, its rows and its notes in one
place), and they reach into the loaders' private stages to time them one by one.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

import saev_shards as ss

PACKAGE = Path(ss.__file__).parent
BENCHMARKS = PACKAGE.parent / "benchmarks"
UNIT = PACKAGE.parent / "tests" / "unit"

MAX_TOP_LEVEL = 10
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 320
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8

#: Functions allowed more than `MAX_PARAMETERS` parameters ("module:qualified name" -> why).
#: Each is a documented public constructor or entry point whose keywords are API, typed so
#: that a user's type checker sees a misspelt keyword; the tests fail once one is not needed.
MANY_PARAMETERS = {
    "loaders.token_loader:TokenLoader.__init__": (
        "the loaders' constructor: each keyword is documented API (docs/loaders.md, help(TokenLoader)), "
        "ShuffledLoader and OrderedLoader take the same ones"
    ),
    "loaders.datasets:TokenDataset.__init__": "the map-style dataset's constructor: the loaders' selection keywords",
    "writer.shard_writer:ShardWriter.__init__": (
        "the writer's constructor: each keyword is documented API (docs/writing.md, help(ShardWriter)), "
        "saev's own code passes them by name"
    ),
    "shuffle.ranks:run_rank": (
        "the public entry point of one rank's share of a shuffle (saev_shards.shuffle.run_rank, docs/remote.md): "
        "its keywords are API, the command line's --wait among them"
    ),
    "dump.run:dump": (
        "the Python entry point of `saev-shards dump`: one keyword per command-line option (docs/dump.md), "
        "the configuration itself in a DumpConfig"
    ),
}

#: Uses of another package's private names that wait for work in flight elsewhere
#: ("module: what" as `private_uses` reports it, less the line number -> why). The test
#: fails once one is gone, so the entry goes with it.
PENDING_PRIVATE: dict[str, str] = {}

#: Docstrings that still cite the source documents ("path: hit" -> why), as `PENDING_PRIVATE`.
PENDING_HISTORY: dict[str, str] = {}

#: Modules with logic and no mirrored test module yet ("saev_shards/pkg/mod.py", or a folder
#: "saev_shards/pkg/" for every such module in it) -> the suites that exercise them, through
#: the public API mostly. A module that gets its mirrored test module leaves this table (the
#: tests fail on an entry that covers nothing); a new module needs its own test module.
TESTED_ELSEWHERE: dict[str, tuple[str, ...]] = {
    # `saev-shards dump` runs a model (the demo's bundled one): tried as a user runs it, the
    # command line in a subprocess, output and exit code read.
    "saev_shards/cli/dump.py": ("tests/integration/test_dump_cli.py",),
    # `make demo`: dumps with the bundled model and trains, run as a user runs it (a subprocess).
    "saev_shards/demo/run.py": ("tests/integration/test_demo.py",),
    # Finds a dumped model's tokenizer offline: needs a model's files (the demo's bundled one).
    "saev_shards/dump/tokenizer.py": ("tests/integration/test_dump_tokenizer.py",),
}

#: Statements a package ``__init__`` may hold besides a docstring, imports and ``__all__``
#: ("package: first line of the statement" -> why).
INIT_EXTRAS = {
    "saev_shards: __version__ = ": "the distribution's version, read by the build (pyproject.toml)",
    "saev_shards: if not TYPE_CHECKING:": (
        "the package's __getattr__: earlier module names (saev_shards.layout, ...) as attributes, "
        "answered by _compat; hidden from type checkers so that a misspelt ss.name stays a type error"
    ),
    "saev_shards.fileio: fault_hook: ": (
        "the crash and race suites' hook, set on the package (fileio.fault_hook = ...) and read there by "
        "fileio.faults.fault_point: it must be the package's own attribute"
    ),
}

#: The tracker's numbers and the source documents' (seeds 000 to 004), as prose cites them;
#: a random seed's value (xxh3's ``seed 0``) is not one.
HISTORY = re.compile(r"\bissues? #?\d+\b|\bseeds? 00\d\b", re.IGNORECASE)


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name below ``root``'s parent (``saev_shards.reader.open``) -> path."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def short(module: str) -> str:
    """``saev_shards.loaders.datasets`` -> ``loaders.datasets`` (the root: ``saev_shards``)."""
    return module.partition(".")[2] or module


# -- sizes -------------------------------------------------------------------------------


def sizes(tree: ast.Module) -> Iterator[tuple[str, str, int, int]]:
    """``(kind, qualified name, lines, parameters)`` of every class and function, nested ones
    included. Lines run from the ``def`` or ``class`` line (decorators left out) to the last."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                yield "class", name, child.end_lineno - child.lineno + 1, 0  # type: ignore[operator]
                yield from visit(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                args = child.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
                count = sum(p.arg not in ("self", "cls") for p in params)
                yield "function", name, child.end_lineno - child.lineno + 1, count  # type: ignore[operator]
                yield from visit(child, name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def size_problems(root: Path = PACKAGE) -> tuple[list[str], set[str]]:
    """Every module, class and function over its limit (less `MANY_PARAMETERS`), and the
    exemptions that were used."""
    problems, used = [], set()
    for module, path in modules(root).items():
        text = path.read_text()
        where = path.relative_to(root.parent)
        n_lines = len(text.splitlines())
        if n_lines > MAX_MODULE_LINES:
            problems.append(f"{where}: {n_lines} lines (at most {MAX_MODULE_LINES})")
        for kind, name, lines, params in sizes(ast.parse(text)):
            limit = MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES
            if lines > limit:
                problems.append(f"{where}: {kind} {name}: {lines} lines (at most {limit})")
            if params > MAX_PARAMETERS:
                key = f"{short(module)}:{name}"
                if key in MANY_PARAMETERS:
                    used.add(key)
                else:
                    problems.append(f"{where}: {name}: {params} parameters (at most {MAX_PARAMETERS})")
    return problems, used


def test_at_most_ten_modules_at_the_top_level():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules beside the packages: {top}"


def test_no_module_class_or_function_over_its_limits():
    problems, _ = size_problems()
    assert not problems, "\n".join(problems)


def test_every_exemption_is_still_needed():
    _, used = size_problems()
    assert set(MANY_PARAMETERS) == used, f"no longer needed: {sorted(set(MANY_PARAMETERS) - used)}"


# -- private names -----------------------------------------------------------------------


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_private_names(files: dict[str, Path]) -> dict[str, set[str]]:
    """Private name -> the packages that define it (a function, a class, an attribute set or
    a name assigned anywhere in one of their modules)."""
    defined: dict[str, set[str]] = {}
    for module, path in files.items():
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if is_private(name):
                defined.setdefault(name, set()).add(package_of(module, path))
    return defined


def private_uses(files: dict[str, Path]) -> list[str]:
    """Every private name one package takes from another (module docstring)."""
    defined = defined_private_names(files)
    found = []
    for module, path in files.items():
        package = package_of(module, path)
        for node in ast.walk(parse(path)):
            where = f"{short(module)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                target = ".".join(part for part in (base, node.module or "") if part)
                if target not in files and not target.startswith("saev_shards."):
                    continue  # another distribution's
                home = target if files.get(target, Path()).name == "__init__.py" else target.rpartition(".")[0]
                if home == package:
                    continue
                for alias in node.names:
                    private_module = any(is_private(part) for part in target.split("."))
                    if private_module or is_private(alias.name):
                        found.append(f"{where}: from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    private = parts[0] == "saev_shards" and any(map(is_private, parts))
                    if private and ".".join(parts[:-1]) != package:
                        found.append(f"{where}: import {alias.name}")
            elif isinstance(node, ast.Attribute) and is_private(node.attr):
                owners = defined.get(node.attr, set())
                if owners and package not in owners and ast.unparse(node.value) not in ("self", "cls"):
                    found.append(f"{where}: {ast.unparse(node)} (defined in {', '.join(sorted(owners))})")
    return found


def without_line(found: str) -> str:
    """``"loaders.mapped:313: x"`` -> ``"loaders.mapped: x"``."""
    return re.sub(r":\d+:", ":", found, count=1)


def test_no_private_name_is_used_across_packages():
    found = private_uses(modules())
    new = [line for line in found if without_line(line) not in PENDING_PRIVATE]
    assert not new, "\n".join(new)
    gone = set(PENDING_PRIVATE) - set(map(without_line, found))
    assert not gone, f"no longer pending: {sorted(gone)}"


# -- package __init__ modules ------------------------------------------------------------


def init_extras(root: Path) -> list[str]:
    """``"package: first line"`` of each statement of a package ``__init__`` that is not a
    docstring, an import or ``__all__``."""
    found = []
    for module, path in modules(root).items():
        if path.name != "__init__.py":
            continue
        for stmt in parse(path).body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # the docstring
            targets = stmt.targets if isinstance(stmt, ast.Assign) else []
            if [ast.unparse(t) for t in targets] == ["__all__"]:
                continue
            first = ast.unparse(stmt).splitlines()[0]
            found.append(f"{module}: {first}")
    return found


def test_every_package_init_only_re_exports():
    extras = init_extras(PACKAGE) + init_extras(BENCHMARKS)
    unexplained = [line for line in extras if not any(line.startswith(key) for key in INIT_EXTRAS)]
    assert not unexplained, "\n".join(unexplained)
    unused = [key for key in INIT_EXTRAS if not any(line.startswith(key) for line in extras)]
    assert not unused, f"no longer needed: {unused}"


# -- no tracker history in docstrings and comments ---------------------------------------


def prose(text: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every docstring and comment of a module's source."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def history(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_no_docstring_or_comment_cites_the_tracker_or_the_seeds():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {', '.join(hits)}"
        for root in (PACKAGE, BENCHMARKS)
        for path in sorted(root.rglob("*.py"))
        for line, text in prose(path.read_text())
        if (hits := history(text))
    ]
    new = [line for line in found if without_line(line) not in PENDING_HISTORY]
    assert not new, "\n".join(new)
    gone = set(PENDING_HISTORY) - set(map(without_line, found))
    assert not gone, f"no longer pending: {sorted(gone)}"


# -- the scanner itself ------------------------------------------------------------------


def write_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / "saev_shards" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(tmp_path / "saev_shards")


def test_the_scan_finds_private_names_taken_from_another_package(tmp_path: Path):
    files = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "reader/__init__.py": "",
            "reader/handles.py": "class Handles:\n    def _fd(self, k):\n        return k\n",
            "reader/reads.py": "from .handles import Handles\ndef f(h):\n    return h._fd(0)\n",
            "loaders/__init__.py": "",
            "loaders/mapped.py": (
                "from ..reader.handles import _helper\nfrom ..reader import _indexing\n"
                "def g(shards):\n    return shards._fd(0) + shards._unknown_elsewhere\n"
            ),
        },
    )
    found = private_uses(files)
    assert found == [
        "loaders.mapped:1: from saev_shards.reader.handles import _helper",
        "loaders.mapped:2: from saev_shards.reader import _indexing",
        "loaders.mapped:4: shards._fd (defined in saev_shards.reader)",
    ]


def test_the_scan_counts_lines_and_parameters_as_the_rules_say():
    tree = ast.parse(
        "class A:\n"
        "    @staticmethod\n"
        "    def f(self, a, b=1, *args, c, **kw):\n"
        "        def inner(x):\n"
        "            return x\n"
        "        return a\n"
    )
    assert list(sizes(tree)) == [
        ("class", "A", 6, 0),
        ("function", "A.f", 4, 5),
        ("function", "A.f.inner", 2, 1),
    ]


def test_the_scan_sees_init_statements_that_are_not_re_exports(tmp_path: Path):
    write_package(
        tmp_path,
        {
            "__init__.py": '"""Doc."""\nfrom .a import x\n__all__ = ["x"]\n',
            "p/__init__.py": "from .b import y\nz = y\ndef helper():\n    pass\n",
        },
    )
    assert init_extras(tmp_path / "saev_shards") == ["saev_shards.p: z = y", "saev_shards.p: def helper():"]


@pytest.mark.parametrize(
    ("text", "hits"),
    [
        ("Run folders (seed 004)", ["seed 004"]),
        ("as issue 12 asked, and Issues #3", ["issue 12", "Issues #3"]),
        ("the XXH3 hash (seed 0) of the bytes", []),
        ("a shuffle's seed 7 and 8 issues", []),
        ("the tracker's history", []),
    ],
)
def test_the_history_pattern(text: str, hits: list[str]):
    assert history(text) == hits


# -- tests/unit mirrors the packages -----------------------------------------------------


def has_logic(path: Path) -> bool:
    """Whether a module defines a function or a class (a package ``__init__`` that re-exports,
    a compatibility shim that forwards, a ``__main__`` that calls: none)."""
    return path.name not in ("__init__.py", "__main__.py") and any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in parse(path).body
    )


def mirror_of(path: Path) -> Path:
    """``saev_shards/reader/open.py`` -> ``tests/unit/reader/test_open.py``; a private
    module's test drops the underscore (``codecs/_float8_numba.py`` -> ``codecs/test_float8_numba.py``)."""
    relative = path.relative_to(PACKAGE)
    return UNIT.joinpath(*relative.parts[:-1], "test_" + relative.name.lstrip("_"))


def unmirrored() -> list[str]:
    return [
        str(path.relative_to(PACKAGE.parent))
        for path in modules().values()
        if has_logic(path) and not mirror_of(path).exists()
    ]


def covering(name: str) -> str | None:
    """The `TESTED_ELSEWHERE` entry that covers module ``name``: its own, else its folder's."""
    if name in TESTED_ELSEWHERE:
        return name
    folder = name.rpartition("/")[0] + "/"
    return folder if folder in TESTED_ELSEWHERE else None


def test_every_module_with_logic_has_its_test_module():
    missing = [name for name in unmirrored() if covering(name) is None]
    assert not missing, "modules without tests/unit/<package>/test_<module>.py:\n" + "\n".join(missing)


def test_every_entry_tested_elsewhere_is_still_needed():
    used = {covering(name) for name in unmirrored()}
    assert set(TESTED_ELSEWHERE) <= used, f"no longer needed: {sorted(set(TESTED_ELSEWHERE) - used)}"
    named = {where for suites in TESTED_ELSEWHERE.values() for where in suites}
    gone = sorted(where for where in named if not (PACKAGE.parent / where).is_file())
    assert not gone, f"named test files that do not exist: {gone}"


def test_the_mirror_of_a_module():
    assert mirror_of(PACKAGE / "reader" / "open.py") == UNIT / "reader" / "test_open.py"
    assert mirror_of(PACKAGE / "codecs" / "_float8_numba.py") == UNIT / "codecs" / "test_float8_numba.py"
    assert mirror_of(PACKAGE / "world.py") == UNIT / "test_world.py"
