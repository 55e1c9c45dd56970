"""writer.staging: the lock beside a staging directory keeps two writers of the same shards
apart, and a published cache is never written again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards.protocol.staging import lock_path, staging_dir

from ...support.caches import logical_tensor, small_metadata, tree_bytes, write_cache


def test_already_published_is_an_error(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md)
    before = tree_bytes(root / md.hash)
    with pytest.raises(ss.AlreadyPublishedError, match="already published"):
        ss.ShardWriter(root, md)
    assert isinstance(ss.AlreadyPublishedError("x"), FileExistsError)
    # The refused second write touched nothing: the published cache is as it was, no staging.
    assert tree_bytes(root / md.hash) == before
    assert not staging_dir(root, md).exists()
    assert sorted(p.name for p in root.iterdir()) == [md.hash]


def test_same_rank_twice_is_busy(root: Path) -> None:
    md = small_metadata()
    a = ss.ShardWriter(root, md, durable=False)
    with pytest.raises(ss.WriterBusyError, match="locked by another writer"):
        ss.ShardWriter(root, md, durable=False)
    a.abort()


def test_same_rank_twice_is_busy_before_touching_the_first_ones_files(root: Path) -> None:
    md = small_metadata()
    first = ss.ShardWriter(root, md, rank=1, world_size=2, durable=False, background=False)
    first.write(logical_tensor(md)[first.start : first.start + 5])  # shard 2 sealed
    staging = staging_dir(root, md)
    sealed = sorted(p.name for p in staging.iterdir())
    with pytest.raises(ss.WriterBusyError, match=r"shards \[2, 5\) are being written by another process"):
        ss.ShardWriter(root, md, rank=1, world_size=2, durable=False)
    assert sorted(p.name for p in staging.iterdir()) == sealed
    first.abort()


def test_lock_file_sits_beside_staging_and_goes_with_publishing(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    assert lock_path(root, md).exists() and lock_path(root, md).parent == root
    assert not (staging_dir(root, md) / ".lock").exists()
    assert ss.store.list_unpublished(root) == [staging_dir(root, md)]  # the lock file is not listed
    w.write(logical_tensor(md))
    w.close()
    assert sorted(os.listdir(root)) == [md.hash]
