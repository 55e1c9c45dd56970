"""The first batch of a new loader's epoch, read in place from the page cache, is gathered once its
window is indexed and checked, without waiting for the window's pages to be mapped; the order is
the same (test_exact_batches.py pins it), and a shard cut short is still an error."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from saev_shards import loaders
from saev_shards.errors import FileSizeError
from saev_shards.loaders import mapped, schedule, windows

from ...support.caches import expected_vectors, small_metadata
from ...support.loaders import check_batch

WINDOWED: dict[str, Any] = dict(batch_size=7, buffer_bytes=800, block_bytes=320, mix_layers=True)


def test_the_first_batch_does_not_wait_for_its_window_to_be_mapped(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first window's loading (its pages' residency and mapping) is held until the first batch
    has arrived: the batch comes anyway, and every vector of the epoch comes once."""
    md = small_metadata()
    shards, logical = make_cache(md)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    first_arrived = threading.Event()
    held: list[bool] = []
    real_read = windows.WindowLoader._read_blocks

    def read_blocks(self: windows.WindowLoader, slot: int, ids: Any, *args: Any) -> None:
        if ids is self.plan.windows[0].spans and self.epoch.number == 0:
            held.append(first_arrived.wait(timeout=20))
        real_read(self, slot, ids, *args)

    monkeypatch.setattr(windows.WindowLoader, "_read_blocks", read_blocks)
    monkeypatch.setattr(schedule, "CHUNK_BYTES", 1)  # one batch per gather, as with real-sized rows
    loader = loaders.ShuffledLoader(shards, read_threads=1, **WINDOWED)
    it = iter(loader)
    first = next(it)
    first_arrived.set()
    seen = check_batch(first, md, logical)
    for b in it:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    assert held == [True], "the first batch waited for its window's load"
    # A later epoch's first window is mapped already: its load is as quick as the check, no early path.
    assert loader.state_dict()["epoch"] == 1
    seen = []
    for b in loader:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    loader.close()


def test_a_shard_cut_short_before_the_first_batch_is_an_error(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The early check reads each shard's size as the load does: a truncated shard in the page cache
    is a `FileSizeError`, never a SIGBUS from the gathers."""
    md = small_metadata(n_examples=40, patches_per_shard=60)
    shards, _ = make_cache(md)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    loader = loaders.ShuffledLoader(shards, batch_size=7, mix_layers=True, buffer_bytes=1 << 20, block_bytes=320)
    path = shards.shard_path(1)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(FileSizeError):
        for _ in loader:
            pass
    loader.close()
