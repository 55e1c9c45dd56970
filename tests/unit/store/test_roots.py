"""store.roots: which cache a path, a full hash or a unique prefix names, and what is said
when none or several do."""

from __future__ import annotations

from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import store

from ...support.caches import colliding_metadata, small_metadata, write_cache


def test_a_path_a_hash_and_a_unique_prefix_resolve_to_the_cache(root: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    want = root / md.hash
    assert store.resolve(want) == want
    assert store.resolve(md.hash, root) == want
    assert store.resolve(md.hash[:6], [root]) == want
    assert store.resolve(md.hash[:4].upper(), root) == want


def test_too_short_unknown_and_ambiguous_references_are_named(root: Path) -> None:
    a, b = colliding_metadata(4)
    write_cache(root, a)
    write_cache(root, b)
    with pytest.raises(ss.AmbiguousPrefixError) as info:
        store.resolve(a.hash[:4], root)
    assert a.hash in str(info.value) and b.hash in str(info.value)
    with pytest.raises(ss.UnknownCacheError, match="ffff"):
        store.resolve("ffff" if not a.hash.startswith("ffff") else "eeee", root)
    with pytest.raises(ss.CacheRefError):
        store.resolve("ab", root)


def test_the_roots_come_from_the_argument_then_the_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SAEV_SHARDS_ROOT", "SAEV_SCRATCH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ss.RootNotSetError):
        store.shards_roots()
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path))
    assert store.shards_roots() == [store.Root(tmp_path / "saev" / "shards", "SAEV_SCRATCH")]
    assert store.shards_root(tmp_path / "x") == store.Root(tmp_path / "x", "argument")
    assert str(store.Root(tmp_path, "argument")) == f"{tmp_path} (argument)"
