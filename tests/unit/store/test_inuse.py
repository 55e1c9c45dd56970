"""store.inuse: the processes using a cache folder, by its lock or by its open and mapped files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import saev_shards as ss
from saev_shards import store

from ...support.caches import small_metadata, write_cache


def test_this_process_holding_a_cache_is_named(root: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    path = root / md.hash
    assert store.users(path) == []
    shards = ss.open(path)
    shards.shard(0)  # the lock is taken with the first handle
    (holder,) = store.users(path)
    assert holder.pid == os.getpid() and holder.how == "holds the cache's lock"
    assert str(holder).startswith(f"pid {os.getpid()} (this process) (")
    shards.close()
    assert store.users(path) == []
    assert store.users(root / "missing") == []


def test_another_process_with_a_file_open_is_named(root: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    path = root / md.hash
    child = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(path / 'acts000000.bin')!r}, 'rb'); import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
    )
    try:
        found = []
        for _ in range(500):  # until the child has opened it
            found = [h for h in store.users(path) if h.pid == child.pid]
            if found:
                break
            time.sleep(0.01)
        assert len(found) == 1 and "acts000000.bin" in found[0].how
    finally:
        child.communicate(b"")
