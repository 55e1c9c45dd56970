"""Windows read in place (`loaders.mapped`): the same batches as windows read into buffers,
from the page cache or from disk, with every option that changes what a window holds."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards import loaders
from saev_shards.errors import FileSizeError
from saev_shards.loaders import mapped, plan, schedule, windows
from saev_shards.loaders.mapped import CacheMap
from saev_shards.loaders.selection import TokenSelection

from ...support.caches import expected_vectors, small_metadata, write_cache
from ...support.loaders import check_batch, live_loader_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="windows are read in place on Linux only")


def evict(shards: ss.Shards) -> None:
    """Drop the cache's files from the page cache (clean pages only: they were fsynced)."""
    for path in shards.path.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def batches(shards: ss.Shards, in_place: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> list[Any]:
    """Every batch of one epoch, windows read in place or into buffers."""
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0 if in_place else 1 << 62)
    loader = loaders.TokenLoader(shards, **kwargs)
    out = [(b.acts.clone(), b.examples, b.tokens, b.layers, b.labels) for b in loader]
    assert (loader._spares.map is not None) == in_place
    if loader._spares.map is not None:
        assert (loader._spares.map.scales is not None) == (shards.metadata.dtype == "float8_e4m3")
    loader.close()
    return out


def same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            assert (u is None and v is None) or torch.equal(u, v)


CASES: dict[str, dict[str, Any]] = {
    "shuffled, all layers": dict(mix_layers=True),
    "ordered, all layers": dict(order="ordered", mix_layers=True),
    "one layer": dict(layers=11),
    "stacked layers": dict(stack_layers=True),
    "all tokens, rank 1 of 2": dict(tokens="all", rank=1, world_size=2, mix_layers=True),
    "small windows and spans": dict(mix_layers=True, buffer_bytes=700, block_bytes=300),
    "out float32": dict(out_dtype="float32", layers=6),
}


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
@pytest.mark.parametrize("slices", [False, True], ids=["whole examples", "slice by slice"])
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_batches_equal_the_buffered_ones(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, case: str, slices: bool, dtype: str
) -> None:
    """float8_e4m3: the values and their scales both read in place."""
    md = small_metadata(n_examples=37, patches_per_shard=60, layers=(2, 6, 11), dtype=dtype)
    shards, logical = make_cache(md, labels=True)
    if slices:  # a subset of layers is read slice by slice, whatever the slices' size
        monkeypatch.setattr(plan, "MIN_SLICE_READ", 0)
    kwargs = dict(batch_size=9, seed=3, **CASES[case])
    want = batches(shards, False, monkeypatch, **kwargs)
    got = batches(shards, True, monkeypatch, **kwargs)
    same(got, want)
    evict(shards)
    same(batches(shards, True, monkeypatch, **kwargs), want)  # from disk
    if case == "shuffled, all layers":  # and the values themselves, once
        seen = []
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
        for b in loaders.ShuffledLoader(shards, batch_size=9, mix_layers=True):
            seen += check_batch(b, md, logical)
        assert sorted(seen) == sorted(expected_vectors(md))


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_a_cache_larger_than_memory_unmaps_finished_windows(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """Above half the memory, a window's pages are unmapped once it is done with (never the
    windows in use), and the batches are the same."""
    md = small_metadata(n_examples=37, patches_per_shard=60)
    shards, _ = make_cache(md)
    kwargs: dict[str, Any] = dict(batch_size=7, order=order, mix_layers=True, buffer_bytes=800, block_bytes=320)
    monkeypatch.setattr(schedule, "CHUNK_BYTES", 1)  # a batch per gather (two window slots), as with real rows
    want = batches(shards, False, monkeypatch, **kwargs)
    monkeypatch.setattr(mapped, "memory_bytes", lambda: 1)
    unmapped: list[tuple[int, int]] = []
    real = CacheMap.unmap_pages

    def unmap(self: CacheMap, start: int, stop: int) -> None:
        unmapped.append((start, stop))
        real(self, start, stop)

    monkeypatch.setattr(CacheMap, "unmap_pages", unmap)
    same(batches(shards, True, monkeypatch, **kwargs), want)
    loader = loaders.TokenLoader(shards, **kwargs)
    windows = loader.plan(0).windows
    spans = loader._spans
    done = [(int(spans.start[b]), int(spans.stop[b])) for w in windows[:-2] for b in w.spans.tolist()]
    assert sorted(unmapped) == sorted(done)  # every window but the last two (two slots)
    loader.close()


def test_in_place_resumes_mid_epoch_and_masks_tokens(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state taken mid-epoch from a loader reading in place resumes on one reading into
    buffers, and the reverse: the batches do not depend on how windows are read."""
    md = small_metadata(n_examples=40, patches_per_shard=60)
    shards, _ = make_cache(md)
    kwargs: dict[str, Any] = dict(batch_size=7, mix_layers=True, buffer_bytes=900, block_bytes=320)
    full = batches(shards, False, monkeypatch, **kwargs)
    for first, then in ((True, False), (False, True)):
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0 if first else 1 << 62)
        loader = loaders.ShuffledLoader(shards, **kwargs)
        it = iter(loader)
        head = [next(it).acts.clone() for _ in range(5)]
        state = loader.state_dict()
        loader.close()
        monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0 if then else 1 << 62)
        resumed = loaders.ShuffledLoader(shards, **kwargs)
        resumed.load_state_dict(state)
        tail = [b.acts.clone() for b in resumed]
        assert all(torch.equal(a, b[0]) for a, b in zip(head + tail, full, strict=True))


def test_a_shard_cut_short_on_disk_is_a_file_size_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages not in the page cache are read with pread first: a shard truncated after open is
    the reader's `FileSizeError` in the training loop, never a SIGBUS."""
    md = small_metadata(n_examples=40, patches_per_shard=60)
    write_cache(tmp_path, md)
    shards = ss.open(tmp_path / md.hash)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    loader = loaders.OrderedLoader(shards, batch_size=7, mix_layers=True, buffer_bytes=600, block_bytes=320)
    path = shards.shard_path(1)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    evict(shards)
    with pytest.raises(FileSizeError):
        for _ in loader:
            pass
    loader.close()
    gc.collect()
    assert live_loader_threads() == []


def test_the_map_is_released_with_the_loader(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the page cache nothing is copied into the window buffers (which take no memory
    until written), and the address range is unmapped when the loader is closed (the garbage
    collector disabled: nothing waits for it)."""
    md = small_metadata(n_examples=37, patches_per_shard=60)
    shards, _ = make_cache(md)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    copied: list[int] = []
    monkeypatch.setattr(windows.WindowLoader, "_read_block", lambda self, block, *args: copied.append(block))
    gc.collect()
    gc.disable()
    try:
        loader = loaders.ShuffledLoader(shards, batch_size=9, mix_layers=True)
        assert sum(len(b) for b in loader) == len(expected_vectors(md))
        assert loader._spares.map is not None
        regions = [weakref.ref(r) for r in loader._spares.map.regions]
        loader.close()  # the loader itself still referenced: close alone unmaps
        alive = [r for r in regions if r() is not None]
        del loader
    finally:
        gc.enable()
    assert copied == [] and regions and alive == []


def test_a_window_read_from_disk_goes_into_its_buffer(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window not in the page cache is read into its slot's buffer (the read is the copy, as
    it always was); one in the page cache is read in place. Both give the same batches."""
    md = small_metadata(n_examples=37, patches_per_shard=60)
    shards, _ = make_cache(md)
    kwargs: dict[str, Any] = dict(batch_size=7, mix_layers=True, buffer_bytes=800, block_bytes=320)
    want = batches(shards, False, monkeypatch, **kwargs)
    modes: list[bool] = []
    real = windows.WindowLoader._index

    def index(self: windows.WindowLoader, w: int) -> Any:
        modes.append(self.in_place[w])
        return real(self, w)

    monkeypatch.setattr(windows.WindowLoader, "_index", index)
    evict(shards)
    same(batches(shards, True, monkeypatch, **kwargs), want)
    cold = list(modes)
    modes.clear()
    same(batches(shards, True, monkeypatch, **kwargs), want)  # now in the page cache
    # The first window was on disk (later ones may have come in with the kernel's readahead).
    assert not cold[0] and modes and all(modes)


@pytest.mark.parametrize("layers", [None, (2, 11)])
def test_the_map_places_every_vector(make_cache: Any, monkeypatch: pytest.MonkeyPatch, layers: Any) -> None:
    """The vector an index points at in the map holds that unit's values, in every shard (the
    padding between shards never indexed), reading whole examples or slice by slice."""
    md = small_metadata(n_examples=23, patches_per_shard=20, layers=(2, 6, 11))
    shards, logical = make_cache(md)
    monkeypatch.setattr(plan, "MIN_SLICE_READ", 0)
    cache_map = CacheMap(shards)
    selection = TokenSelection(shards, layers=layers, tokens="all")
    spans = plan.ReadSpans(shards, selection, 500)
    order = np.arange(len(spans))
    for window in plan.plan_epoch(spans, order, 0, 1, 12, 5, False).windows:
        index = plan.index_window(selection, spans, window, np.random.default_rng(0), cache_map.source)
        positions = [md.layers.index(v) for v in index.layers.tolist()]  # type: ignore[union-attr]
        np.testing.assert_array_equal(cache_map.values[index.flat], logical[index.examples, positions, index.tokens])


def test_the_ordered_walk_reads_with_two_threads() -> None:
    assert loaders.default_read_threads(sequential=True) == 2
    assert loaders.default_read_threads(device_side=True, sequential=True) >= 4
    assert loaders.default_read_threads() >= 4


def test_too_many_shards_for_the_mappings_allowed_are_read_into_buffers(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    md = small_metadata(n_examples=37, patches_per_shard=60)
    shards, _ = make_cache(md)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    assert mapped.available(shards)
    monkeypatch.setattr(mapped, "max_map_count", lambda: 4 * 2 * shards.n_shards - 1)
    assert not mapped.available(shards)


def test_blocks_still_resident_are_asked_about_a_run_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`CacheMap.still_resident`: blocks mapped before, whose shard holds them and whose pages are
    in the page cache, need nothing more; neighbouring blocks of one shard are one ``fstat`` and
    one ``mincore``; blocks never mapped, evicted, or of a shard cut short are left to
    `make_resident` (which reads them, or raises the first block's `FileSizeError`)."""
    md = small_metadata(n_examples=40, patches_per_shard=60)
    write_cache(tmp_path, md)
    shards = ss.open(tmp_path / md.hash)
    cache_map = CacheMap(shards)
    spans = plan.ReadSpans(shards, TokenSelection(shards, tokens="all"), 320)
    starts, stops = spans.start.astype(np.int64), spans.stop.astype(np.int64)
    assert len(starts) > shards.n_shards  # several blocks a shard
    assert not cache_map.still_resident(starts, stops).any()  # never mapped
    stop_event = threading.Event()
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        cache_map.make_resident(a, b, spans, stop_event)
    calls: list[tuple[int, int]] = []
    resident = cache_map.resident

    def counted(addr: int, nbytes: int) -> bool:
        calls.append((addr, nbytes))
        return resident(addr, nbytes)

    monkeypatch.setattr(cache_map, "resident", counted)
    assert cache_map.still_resident(starts, stops).all()
    assert len(calls) == shards.n_shards  # one run a shard: its blocks follow one another
    calls.clear()
    shard = starts // md.examples_per_shard
    pair = int(np.flatnonzero(shard[1:] == shard[:-1])[0])  # two blocks of one shard
    picked = np.array([pair, pair + 1, len(starts) - 1])  # a gap before the last: two runs
    assert cache_map.still_resident(starts[picked], stops[picked]).all() and len(calls) == 2
    assert cache_map.still_resident(starts[:0], stops[:0]).shape == (0,)
    reclaimed(cache_map, shards)
    assert not cache_map.still_resident(starts, stops).any()
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        cache_map.make_resident(a, b, spans, stop_event)  # read again, from disk
    assert cache_map.still_resident(starts, stops).all()
    path = shards.shard_path(1)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    found = cache_map.still_resident(starts, stops)
    in_shard_1 = shard == 1
    assert not found[in_shard_1].any() and found[~in_shard_1].all()
    last = int(np.flatnonzero(in_shard_1)[-1])  # past the half left
    with pytest.raises(FileSizeError, match="truncated"):
        cache_map.make_resident(int(starts[last]), int(stops[last]), spans, stop_event)
    shards.close()


def reclaimed(cache_map: CacheMap, shards: ss.Shards) -> None:
    """What memory pressure does to a mapped cache (a page mapped into a process is not dropped by
    ``POSIX_FADV_DONTNEED``): its pages unmapped behind the map's back, then evicted."""
    libc = mapped._get_libc()
    for region in cache_map.regions:
        assert libc.madvise(region.start, region.length, mapped._MADV_DONTNEED) == 0
    evict(shards)


@pytest.mark.parametrize("between", ["evicted", "cut short"])
def test_a_later_epoch_read_in_place_sees_what_changed_since_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, between: str
) -> None:
    """A loader's later epochs check its mapped windows a run at a time: the cache evicted between
    epochs is read again (the same batches), a shard cut short is a `FileSizeError`."""
    md = small_metadata(n_examples=40, patches_per_shard=60)
    write_cache(tmp_path, md)
    shards = ss.open(tmp_path / md.hash)
    monkeypatch.setattr(mapped, "MIN_SHARD_BYTES", 0)
    loader = loaders.OrderedLoader(shards, batch_size=7, mix_layers=True, buffer_bytes=2000, block_bytes=320)
    first = [b.acts.clone() for b in loader]
    assert loader._spares.map is not None and loader._spares.map.populated.all()
    if between == "evicted":
        reclaimed(loader._spares.map, shards)
        again = [b.acts.clone() for b in loader]
        assert len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    else:
        path = shards.shard_path(2)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
        with pytest.raises(FileSizeError, match="truncated"):
            for _ in loader:
                pass
    loader.close()
    shards.close()
