"""store.remote_roots: how a reference to a cache in an object store is resolved, and the roots
found below a bucket's top (the listing itself is the storage client's, faked here; the
integration suite runs them against an S3 server)."""

from __future__ import annotations

import importlib
from typing import ClassVar

import pytest

import saev_shards as ss

#: The module (``saev_shards.store.remote_roots`` as an attribute is `roots.remote_roots`, a function).
remote_roots = importlib.import_module("saev_shards.store.remote_roots")
HASH = "ab" * 32


class Listing:
    """A storage client over a fixed listing of keys."""

    keys: ClassVar[list[str]] = []
    can_list = True

    def __init__(self, url: str) -> None:
        self.url = url

    def list_objects(self) -> list[str]:
        return list(self.keys)


def test_nested_roots_are_the_folders_holding_published_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_roots, "Client", Listing)
    monkeypatch.setattr(
        Listing,
        "keys",
        [
            f"team/a/{HASH}/shards.json",
            f"team/a/{HASH}/metadata.json",
            f"b/{'cd' * 32}/shards.json",
            f"c/.staging-{HASH}/shards.json",  # not a cache's name
            "d/shards.json",
        ],
    )
    assert remote_roots.nested_roots("s3://bucket") == ["s3://bucket/b", "s3://bucket/team/a"]
    assert remote_roots.nested_roots("s3://bucket", limit=1) == ["s3://bucket/b"]
    monkeypatch.setattr(Listing, "can_list", False)
    assert remote_roots.nested_roots("s3://bucket") == []


def test_a_full_hash_or_an_unlistable_root_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_roots, "Client", Listing)
    assert remote_roots.resolve_remote(f"s3://bucket/root/{HASH}") == f"s3://bucket/root/{HASH}"
    monkeypatch.setattr(Listing, "can_list", False)
    assert remote_roots.resolve_remote("https://host/root/abcd12") == "https://host/root/abcd12"
    with pytest.raises(ss.CacheRefError, match="hash prefix 'abc' is too short: expected at least 4 hex digits"):
        remote_roots.resolve_remote("s3://bucket/root/abc")
