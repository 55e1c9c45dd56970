"""The reader package's shape: it takes paths and never imports the store; `saev_shards.open`
resolves references through the store, then opens the path."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import reader, store

from ...support.caches import small_metadata, write_cache

PACKAGE = Path(ss.__file__).parent
READER = PACKAGE / "reader"


def test_importing_the_reader_imports_neither_the_store_nor_the_writer():
    # The package's own __init__ imports everything (ss.store, ss.ShardWriter): a bare package
    # module in its place shows what `saev_shards.reader` itself pulls in.
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('saev_shards'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['saev_shards'] = pkg\n"
        "import saev_shards.reader\n"
        "print(sorted(m for m in sys.modules if m.startswith('saev_shards')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))  # a printed list of module names
    assert "saev_shards.reader.shards" in loaded and "saev_shards.reader.sidecars" in loaded
    assert not {m for m in loaded if m.startswith(("saev_shards.store", "saev_shards.writer"))}


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function, as absolute names."""
    package = "saev_shards.reader"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_of_the_reader_imports_the_store_even_lazily():
    files = sorted(READER.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        bad = {m for m in _imported_modules(path) if m.startswith(("saev_shards.store", "saev_shards.writer"))}
        assert not bad, f"{path} imports {sorted(bad)}"


def test_the_import_scan_sees_lazy_imports(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..store import resolve\n    from .. import store\n")
    assert {"saev_shards.store", "saev_shards.store.resolve"} <= _imported_modules(probe)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    md = small_metadata()
    write_cache(root, md, batches=[7], stats=False)
    return root / md.hash


def test_reader_open_takes_paths_only(cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SAEV_SHARDS_ROOT", str(cache.parent))
    monkeypatch.chdir(cache.parent.parent)
    prefix = cache.name[:6]
    with pytest.raises(ss.CacheNotFoundError, match=f"no cache at .*/{prefix}: no such file or directory"):
        reader.open(prefix)
    assert reader.open(cache).path == cache
    # saev_shards.open (store.open_cache) resolves the prefix, then opens the path.
    assert ss.open is store.open_cache
    assert ss.open(prefix).path == cache
    assert ss.open(prefix, roots=cache.parent).path == cache
    with pytest.raises(ss.UnknownCacheError):
        ss.open("beefbeef", roots=cache.parent)


def test_old_import_spellings_keep_working(cache: Path):
    from saev_shards.reader import Fields, Shards, TextColumn, find_stats, open, sidecar_path
    from saev_shards.store import find_stats as store_find_stats
    from saev_shards.store import sidecar_path as store_sidecar_path

    shards = open(cache)
    assert isinstance(shards, Shards) and ss.Shards is Shards and ss.TextColumn is TextColumn
    assert isinstance(shards.text, Fields)
    assert store_find_stats is find_stats and store_sidecar_path is sidecar_path
    assert find_stats(shards) is None and shards.stats is None  # no stats.json, no sidecar


def test_a_pickled_shards_reopens_its_own_handles(cache: Path):
    shards = ss.open(cache)
    first = shards.read_example(0, 0).copy()
    assert shards._fds  # a descriptor is open in this process
    copy = pickle.loads(pickle.dumps(shards))
    assert copy._fds == {} and copy._maps == {}
    assert (copy.read_example(0, 0) == first).all()
    assert copy._fds and set(copy._fds.values()).isdisjoint(shards._fds.values())
