"""reader.slices: a span's chosen ``(example, layer)`` slices into a buffer at once
(`read_slices_raw`, `read_slices_scales`: the loaders' cold path for a layer selection), against
reading each slice with `read_example_raw` and `read_example_scales`: the same bytes, runs of
neighbouring layers in one ``preadv``, short reads finished, the same errors."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.errors import FileSizeError

from ...support import strategies
from ...support.caches import small_metadata, write_cache


def _slice_by_slice(
    shards: ss.Shards, start: int, stop: int, positions: list[int], rows: list[int], n_rows: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """What `read_example_raw` (and `read_example_scales`) of each slice give, in a buffer of
    ``n_rows`` rows per example whose other rows hold 0x5A bytes."""
    md = shards.metadata
    shape = (stop - start, n_rows, md.tokens_per_ex)
    out = np.full((*shape, md.d_model * md.itemsize), 0x5A, np.uint8).view(shards.numpy_dtype)
    scales = None
    if md.dtype == "float8_e4m3":
        scales = np.full((*shape, 4), 0x5A, np.uint8).view(np.float32).reshape(shape)
    for e in range(stop - start):
        for row, p in zip(rows, positions, strict=True):
            shards.read_example_raw(start + e, p, out[e, row])
            if scales is not None:
                shards.read_example_scales(start + e, p, scales[e, row])
    return out, scales


@given(strategies.metadata(min_examples=1), st.data())
def test_read_slices_equals_reading_each_slice(md: ss.Metadata, data: st.DataObject) -> None:
    """Any range (across shards), any positions in any order, into any rows of a wider buffer:
    each slice's bytes (and a float8_e4m3 cache's scales) as `read_example_raw` gives them, the
    other rows untouched."""
    with tempfile.TemporaryDirectory() as tmp:
        write_cache(Path(tmp), md, batches=[5])
        shards = ss.open(Path(tmp) / md.hash)
        start = data.draw(st.integers(0, md.n_examples))
        stop = data.draw(st.integers(start, md.n_examples))
        positions = data.draw(st.lists(st.integers(0, md.n_layers - 1), min_size=1, unique=True))
        n_rows = data.draw(st.integers(len(positions), md.n_layers + 2))
        rows = data.draw(st.permutations(range(n_rows)))[: len(positions)]
        expected, expected_scales = _slice_by_slice(shards, start, stop, positions, rows, n_rows)
        out = np.empty_like(expected)
        out.view(np.uint8)[...] = 0x5A
        assert shards.read_slices_raw(start, stop, positions, out, rows) is out
        np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
        if expected_scales is not None:
            scales = np.empty_like(expected_scales)
            scales.view(np.uint8)[...] = 0x5A
            assert shards.read_slices_scales(start, stop, positions, scales, rows) is scales
            np.testing.assert_array_equal(scales.view(np.uint8), expected_scales.view(np.uint8))
        if rows == list(range(len(positions))):  # the default rows
            again = np.empty_like(expected)
            again.view(np.uint8)[...] = 0x5A
            shards.read_slices_raw(start, stop, positions, again)
            np.testing.assert_array_equal(again.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize(
    ("positions", "rows", "calls_per_example"),
    [
        ([1], [0], 1),  # one layer of three
        ([0, 1], [0, 1], 1),  # neighbours: one read of both
        ([1, 0], [0, 1], 1),  # neighbours in the file, rows swapped: one read scattered into both
        ([2, 0], [0, 1], 2),  # apart in the file: a read each
        ([0, 2], [0, 2], 2),  # whole examples laid out, two of three read
        ([0, 1, 2], [2, 1, 0], 1),
    ],
)
def test_read_slices_reads_runs_of_neighbours_at_once(
    root: Path, monkeypatch: pytest.MonkeyPatch, positions: list[int], rows: list[int], calls_per_example: int
) -> None:
    md = small_metadata(layers=(2, 6, 11))
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    expected, _ = _slice_by_slice(shards, 3, 12, positions, rows, 3)  # shards 0, 1 and 2
    calls: list[tuple[int, int]] = []
    real = shards._preadv

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        calls.append((offset, sum(v.nbytes for v in views)))
        return real(fd, views, offset)

    monkeypatch.setattr(shards, "_preadv", preadv)
    out = np.empty_like(expected)
    out.view(np.uint8)[...] = 0x5A
    shards.read_slices_raw(3, 12, positions, out, rows)
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
    assert len(calls) == 9 * calls_per_example
    assert sum(n for _, n in calls) == 9 * len(positions) * shards._slice_nbytes


def test_read_slices_finishes_short_reads(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``preadv`` that returns fewer bytes than asked (a signal, a network filesystem) is
    finished, into the right buffers of a scattered read."""
    md = small_metadata(layers=(2, 6, 11), dtype="float8_e4m3")
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    expected, expected_scales = _slice_by_slice(shards, 0, 23, [1, 0, 2], [0, 1, 2], 3)
    real = shards._preadv

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        first = views[0].cast("B")
        return real(fd, [first[: max(1, first.nbytes // 3)]], offset)

    monkeypatch.setattr(shards, "_preadv", short)
    out = np.zeros_like(expected)
    scales = np.zeros_like(expected_scales)
    shards.read_slices_raw(0, 23, [1, 0, 2], out, [0, 1, 2])
    shards.read_slices_scales(0, 23, [1, 0, 2], scales, [0, 1, 2])
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
    np.testing.assert_array_equal(scales, expected_scales)


def test_read_slices_errors(root: Path) -> None:
    md = small_metadata()  # 23 examples, 2 layers, 5 x 8 float16 slices, 5 examples per shard
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    out = np.empty((3, 2, 5, 8), np.float16)
    with pytest.raises(IndexError, match=r"range \[21, 24\) is not within \[0, 23\]"):
        shards.read_slices_raw(21, 24, [0], out)
    with pytest.raises(IndexError, match=r"layer index 2 out of range \[0, 2\)"):
        shards.read_slices_raw(0, 3, [2], out)
    with pytest.raises(IndexError, match=r"row 2 out of range \[0, 2\) of out"):
        shards.read_slices_raw(0, 3, [0], out, [2])
    with pytest.raises(IndexError, match=r"row 1 out of range \[0, 1\) of out"):
        shards.read_slices_raw(0, 3, [0, 1], out[:, :1].copy())
    with pytest.raises(ValueError, match="rows: expected one per position"):
        shards.read_slices_raw(0, 3, [0, 1], out, [0])
    with pytest.raises(ValueError, match=r"out must have shape \(2, 'R', 5, 8\)"):
        shards.read_slices_raw(0, 2, [0], out)
    with pytest.raises(ValueError, match="out must be a C-contiguous float16 array, found a float32 array"):
        shards.read_slices_raw(0, 3, [0], out.astype(np.float32))
    with pytest.raises(ValueError, match="C-contiguous float16 array, found a non-contiguous float16 array"):
        shards.read_slices_raw(0, 3, [0], np.empty((2, 3, 5, 8), np.float16).transpose(1, 0, 2, 3))
    with pytest.raises(ValueError, match="a float16 cache has no scales"):
        shards.read_slices_scales(0, 3, [0], np.empty((3, 2, 5), np.float32))
    assert shards.read_slices_raw(4, 4, [0], out[:0]).shape == (0, 2, 5, 8)


def test_read_slices_of_a_shard_cut_short_or_removed(root: Path) -> None:
    """A shard truncated after open: the `FileSizeError` of `read_example_raw` for the first
    slice past its end; a cache removed before a shard's first read: `CacheNotFoundError`."""
    md = small_metadata()
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    path = shards.shard_path(1)
    cut = 3 * md.n_layers * shards._slice_nbytes + 5  # inside example 8's first slice
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(cut)
    out = np.empty((5, 1, 5, 8), np.float16)
    with pytest.raises(FileSizeError) as before:
        shards.read_example_raw(8, 1, out[3, 0])
    with pytest.raises(FileSizeError) as now:
        shards.read_slices_raw(5, 10, [1], out)
    assert str(now.value) == str(before.value)
    shards.read_slices_raw(5, 8, [1], out[:3])  # what is still there reads
    shards.read_slices_raw(0, 5, [1], out)  # shard 0 open from here on
    for entry in (root / md.hash).iterdir():
        os.chmod(entry, 0o644)
    shutil.rmtree(root / md.hash)
    shards.read_slices_raw(0, 5, [0], out)  # what it had open still reads
    with pytest.raises(ss.CacheNotFoundError, match="the cache was removed while open"):
        shards.read_slices_raw(15, 20, [0], out)
