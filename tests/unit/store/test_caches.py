"""store.caches: what a shards root holds, published caches (opened, sized) and the folders
that are not caches (staging, partial copies), each judged live, resumable or stale."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards import store
from saev_shards.protocol.staging import staging_dir

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
