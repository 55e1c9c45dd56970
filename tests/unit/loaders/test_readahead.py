"""Read-ahead and memory of a running epoch: a window is released as soon as the gathers are
done with it, and an epoch's buffers are freed when it ends, without the garbage collector."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from saev_shards import loaders
from saev_shards.loaders import mapped, outputs, schedule, spares, windows

from ...support.caches import expected_vectors, small_metadata
from ...support.loaders import check_batch

# 23 examples of 2 layers x 4 content tokens (80-byte slices): windows of 5 examples (40
# rows), spans of 2 examples, batches of 7 rows: several batches span two windows.
WINDOWED: dict[str, Any] = dict(batch_size=7, buffer_bytes=800, block_bytes=320, mix_layers=True)


@pytest.mark.parametrize("device", [None, "cpu", "in place"])
@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_the_window_after_next_loads_before_the_next_is_read(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, device: str | None, order: str
) -> None:
    """With two window buffers, window 2 goes into window 0's buffer once the gathers have
    taken their rows of window 0, even while a batch that runs into window 1 waits for it:
    here window 1's reads wait until window 2 has been submitted (they would wait forever if
    window 0 were released only with that batch, as it was before)."""
    md = small_metadata()
    shards, logical = make_cache(md)
    submitted = threading.Event()
    waited: list[bool] = []
    real_submit = windows.WindowLoader.submit
    real_read = windows.WindowLoader._read_blocks

    def submit(self: windows.WindowLoader, w: int) -> Any:
        future = real_submit(self, w)
        if w == 2:
            submitted.set()
        return future

    real_in_place = windows.WindowLoader._load_in_place

    def wait(self: windows.WindowLoader, ids: Any) -> None:
        if ids is self.plan.windows[1].spans and not waited:
            waited.append(submitted.wait(timeout=10))

    def read_blocks(self: windows.WindowLoader, slot: int, ids: Any, *args: Any) -> None:
        wait(self, ids)
        real_read(self, slot, ids, *args)

    def load_in_place(self: windows.WindowLoader, w: int, ids: Any) -> Any:  # a window the page cache holds
        wait(self, ids)
        return real_in_place(self, w, ids)

    monkeypatch.setattr(windows.WindowLoader, "submit", submit)
    monkeypatch.setattr(windows.WindowLoader, "_read_blocks", read_blocks)
    monkeypatch.setattr(windows.WindowLoader, "_load_in_place", load_in_place)
    monkeypatch.setattr(schedule, "CHUNK_BYTES", 1)  # one batch per gather, as with real-sized rows
    if device == "in place":  # the host path, windows read in place (`loaders.mapped`)
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
        device = None
    loader = loaders.TokenLoader(shards, order=order, device=device, read_threads=1, **WINDOWED)
    plan = loader.plan(0)
    assert loader._config.chunk_batches == 1 and len(plan.windows) > 3
    assert plan.window_start[1] % loader.batch_size, "a batch spans windows 0 and 1"
    seen = []
    for b in loader:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    assert waited == [True]


def _epoch(loader: loaders.TokenLoader) -> Iterator[Any]:
    for b in loader:
        yield b.examples


@pytest.mark.parametrize("in_place", [False, True], ids=["buffers", "in place"])
@pytest.mark.parametrize("order", ["ordered", "shuffled"])
def test_an_epoch_frees_its_buffers_when_it_ends(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, order: str, in_place: bool
) -> None:
    """Window buffers and output arrays of a closed loader are freed at once, the garbage
    collector disabled: nothing of a finished epoch waits for a collection (a new loader
    would otherwise touch fresh memory, and its buffers add up until one runs)."""
    md = small_metadata()
    shards, _ = make_cache(md)
    arrays: list[weakref.ref[np.ndarray[Any, Any]]] = []
    real_get = outputs.Recycler.get
    real_take = spares.Spares.take_buffers

    def get(self: outputs.Recycler, *args: Any) -> Any:
        arr = real_get(self, *args)
        arrays.append(weakref.ref(arr))
        return arr

    def take(self: spares.Spares, *args: Any) -> Any:
        buffers = real_take(self, *args)
        arrays.extend(weakref.ref(a) for buffer in buffers for a in buffer if a is not None)
        return buffers

    monkeypatch.setattr(outputs.Recycler, "get", get)
    monkeypatch.setattr(spares.Spares, "take_buffers", take)
    if in_place:
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    gc.collect()
    gc.disable()
    try:
        loader = loaders.TokenLoader(shards, order=order, **WINDOWED)
        assert sum(len(e) for e in _epoch(loader)) == len(expected_vectors(md))
        loader.close()
        del loader
        alive = [r for r in arrays if r() is not None]
    finally:
        gc.enable()
    assert arrays and not alive, f"{len(alive)} of {len(arrays)} arrays still allocated"
