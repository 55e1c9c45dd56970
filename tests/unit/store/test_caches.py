"""store.caches: what a shards root holds, published caches (opened, sized) and the folders
that are not caches (staging, partial copies), each judged live, resumable or stale."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import store
from saev_shards.protocol.staging import staging_dir
from saev_shards.store import caches as store_caches

from ...support.caches import small_metadata, write_cache


def test_list_caches_opens_each_cache_and_reports_what_does_not_open(root: Path) -> None:
    good = small_metadata()
    write_cache(root, good)
    broken = small_metadata(n_examples=7)
    write_cache(root, broken)
    bad = root / broken.hash
    bad.chmod(0o755)
    (bad / "acts000000.bin").chmod(0o644)
    (bad / "acts000000.bin").unlink()
    (root / "notes").mkdir()  # not named by a hash: not a cache
    entries = {e.hash: e for e in store.list_caches(root)}
    assert set(entries) == {good.hash, broken.hash}
    ok = entries[good.hash]
    assert ok.ok and ok.n_shards == good.n_shards and ok.metadata == good
    assert ok.nbytes == store.folder_nbytes(root / good.hash) > good.nbytes
    damaged = entries[broken.hash]
    assert not damaged.ok and damaged.n_shards is None and damaged.metadata == broken
    assert damaged.problem is not None and "acts000000.bin: missing" in damaged.problem


def test_a_file_gone_while_its_folder_is_sized_leaves_the_folder_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live writer renames and removes files in its staging folder as it goes: one gone between
    the folder's listing and its stat is left out of the size, and the folder is still listed (it
    used to vanish from `unpublished` as if it had been published, a race a busy test run met)."""
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((7, *md.shape[1:]), np.float16))
    w.abort()  # its folder stays as it is from here on
    staging = staging_dir(root, md)
    (before,) = store.unpublished(root)
    (staging / "sealing.tmp").write_bytes(b"\0" * 4096)
    real_scan = store_caches._scan  # type: ignore[attr-defined]

    def scan(path: Path) -> Iterator[os.DirEntry[str]]:
        for e in real_scan(path):
            if e.name == "sealing.tmp":
                os.remove(e.path)  # renamed by a writer's thread, say, after the listing
            yield e

    monkeypatch.setattr(store_caches, "_scan", scan)
    (entry,) = store.unpublished(root)
    assert (entry.kind, entry.hash, entry.nbytes, entry.sealed) == ("staging", md.hash, before.nbytes, 1)
    assert not (staging / "sealing.tmp").exists()


def test_an_interrupted_writer_leaves_a_resumable_staging_folder(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((7, *md.shape[1:]), np.float16))  # shard 0 complete, shard 1 begun
    assert store.list_unpublished(root) == [staging_dir(root, md)]
    (entry,) = store.unpublished(root)
    assert (entry.kind, entry.hash, entry.live, entry.state) == ("staging", md.hash, True, "a writer holds it")
    w.abort()
    (entry,) = store.unpublished(root)
    assert not entry.live and entry.resumable and (entry.sealed, entry.n_shards) == (1, 5)
    assert entry.state.startswith("interrupted, resumable (1 of 5 shards sealed): run its writer again to resume")
    assert store.list_caches(root) == []
