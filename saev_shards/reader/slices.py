"""A span's chosen ``(example, layer)`` slices into a buffer at once (`SliceReads`): the loaders'
cold read path for a layer selection.

A window buffer holds a span's examples, each as ``R`` rows of ``(T, D)`` slices (every layer's
row, or one per chosen layer). `SliceReads.read_slices_raw` fills the chosen layers' rows with
the arguments checked once and nothing but ``preadv`` in its loop: one call per example for each
run of neighbouring chosen layers, scattered into their rows. The same bytes as
`reads.RawReads.read_example_raw` of each slice, the same `FileSizeError` where a file ends
first, and `CacheNotFoundError` where the cache was removed before a shard's first read.
`SliceReads.read_slices_scales` gives a float8_e4m3 cache's scales of those slices, checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..fileio import pread_exact
from ..protocol import layout
from ..protocol.common import FLOAT8, SCALES_DTYPE
from ..protocol.float8 import scales_plain
from .reads import _IOV_MAX, ScaleReads


class SliceReads(ScaleReads):
    """A span's chosen slices, and their scales, into a buffer of ``R`` rows per example."""

    def read_slices_raw(
        self, start: int, stop: int, positions: Sequence[int], out: npt.NDArray[Any], rows: Sequence[int] | None = None
    ) -> npt.NDArray[Any]:
        """Copy the stored values of the ``(example, layer)`` slices at layer ``positions`` of
        examples ``[start, stop)`` into ``out`` ``(stop - start, R, T, D)``: position
        ``positions[j]`` of example ``start + e`` into ``out[e, rows[j]]`` (``rows``: by default
        ``0..len(positions)-1``); ``out``'s other rows are left as they are.

        A layer selection's read of a span (the loaders' cold path): the arguments are checked
        once, then one ``preadv`` per example for each run of neighbouring positions (scattered
        into their rows), with nothing else in the loop; `read_example_raw` of each slice reads
        the same bytes. `FileSizeError` if a file ends first; `CacheNotFoundError` if the cache
        was removed before a shard's first read, as every read path.
        """
        self._check_slices(start, stop, positions, out, rows, self.numpy_dtype, self.shape[2:])
        self._read_slices_into(start, stop, positions, rows, out, self._slice_nbytes, self.shard_fd)
        return out

    def _check_slices(
        self,
        start: int,
        stop: int,
        positions: Sequence[int],
        out: npt.NDArray[Any],
        rows: Sequence[int] | None,
        dtype: np.dtype[Any],
        slice_shape: tuple[int, ...],
    ) -> None:
        if not 0 <= start <= stop <= self.n_examples:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n_examples}]")
        n_layers = self.shape[1]
        for p in positions:
            if not 0 <= p < n_layers:
                raise IndexError(f"layer index {p} out of range [0, {n_layers})")
        if out.ndim != 2 + len(slice_shape) or out.shape[0] != stop - start or out.shape[2:] != slice_shape:
            raise ValueError(f"out must have shape {(stop - start, 'R', *slice_shape)}, found {out.shape}")
        if out.dtype != dtype or not out.flags.c_contiguous:
            layout_ = "" if out.flags.c_contiguous else " non-contiguous"
            raise ValueError(f"out must be a C-contiguous {dtype} array, found a{layout_} {out.dtype} array")
        n_rows = out.shape[1]
        if rows is not None:
            if len(rows) != len(positions):
                raise ValueError(f"rows: expected one per position ({len(positions)}), found {len(rows)}")
            bad = [r for r in rows if not 0 <= r < n_rows]
        else:
            bad = [] if len(positions) <= n_rows else [len(positions) - 1]
        if bad:
            raise IndexError(f"row {bad[0]} out of range [0, {n_rows}) of out")

    def _read_slices_into(
        self,
        start: int,
        stop: int,
        positions: Sequence[int],
        rows: Sequence[int] | None,
        out: npt.NDArray[Any],
        slice_nbytes: int,
        fd_of: Callable[[int], int],
    ) -> None:
        """The slices of `read_slices_raw` (``slice_nbytes`` each, in the files ``fd_of(k)``) into
        ``out``, checked already. Each run of neighbouring positions is one ``preadv`` per example,
        its rows in ``out`` (neighbours merged) its buffers."""
        n_layers, n_rows, eps = self.shape[1], out.shape[1], self.examples_per_shard
        chosen = range(len(positions)) if rows is None else rows
        # (first position, [(first row, rows)]) of each run of neighbouring positions, in file order.
        runs: list[tuple[int, int, list[tuple[int, int]]]] = []
        for p, r in sorted(zip((int(p) for p in positions), (int(r) for r in chosen), strict=True)):
            if runs and runs[-1][0] + runs[-1][1] == p and len(runs[-1][2]) < _IOV_MAX:
                first, n, segments = runs[-1]
                runs[-1] = (first, n + 1, segments)
                if segments[-1][0] + segments[-1][1] == r:
                    segments[-1] = (segments[-1][0], segments[-1][1] + 1)
                else:
                    segments.append((r, 1))
            else:
                runs.append((p, 1, [(r, 1)]))
        # In bytes: (offset in an example, bytes, [(offset in an example's rows, bytes)]).
        in_bytes = [(p * slice_nbytes, n * slice_nbytes, [(r * slice_nbytes, m * slice_nbytes) for r, m in seg])
                    for p, n, seg in runs]  # fmt: skip
        view = out.reshape(-1).view(np.uint8).data
        preadv = self._preadv
        file_example, out_example = n_layers * slice_nbytes, n_rows * slice_nbytes
        e, done = start, 0
        while e < stop:
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            fd = fd_of(k)
            for i in range(count):
                at, base = (local + i) * file_example, (done + i) * out_example
                for off, nbytes, segments in in_bytes:
                    parts = [view[base + row : base + row + m] for row, m in segments]
                    got = preadv(fd, parts, at + off)
                    if got != nbytes:
                        _finish(fd, parts, at + off, got, preadv)
            done += count
            e += count

    def read_slices_scales(
        self,
        start: int,
        stop: int,
        positions: Sequence[int],
        out: npt.NDArray[np.float32],
        rows: Sequence[int] | None = None,
    ) -> npt.NDArray[np.float32]:
        """Copy the float32 scales of the slices of `read_slices_raw` into ``out`` ``(stop - start,
        R, T)`` (position ``positions[j]`` of example ``start + e`` into ``out[e, rows[j]]``), then
        check those (`check_scales`).

        The span's scales are read whole, every layer's (one ``pread`` per shard touched; they
        are 4 bytes a vector, and the loaders hint them whole, `prefetch`), and the chosen ones
        copied into their rows: a read per slice cost more in calls than those few bytes. So a
        scale file cut short anywhere in the span's examples is a `FileSizeError`.
        """
        if self.metadata.dtype != FLOAT8:
            raise ValueError(f"{self.path}: a {self.metadata.dtype} cache has no scales (float8_e4m3 caches have)")
        n_layers, tokens = self.shape[1], self.shape[2]
        self._check_slices(start, stop, positions, out, rows, np.dtype(SCALES_DTYPE), (tokens,))
        chosen = [int(p) for p in positions]
        whole = np.empty((stop - start, n_layers, tokens), SCALES_DTYPE)
        self._read_examples_into(start, stop, whole, n_layers * tokens * SCALES_DTYPE.itemsize, self.scale_fd)
        read = whole[:, chosen]  # the chosen scales, in the order of positions
        out[:, list(range(len(chosen))) if rows is None else [int(r) for r in rows]] = read
        if not scales_plain(read):
            numbers = np.asarray(chosen, np.int64)
            self.check_scales(
                read,
                lambda: ((np.arange(start, stop)[:, None, None] * n_layers + numbers[None, :, None]) * tokens
                         + np.arange(tokens)[None, None, :]),
            )  # fmt: skip
        return out


def _finish(
    fd: int, parts: list[memoryview], offset: int, got: int, preadv: Callable[[int, list[memoryview], int], int]
) -> None:
    """Finish a ``preadv`` of ``parts`` from ``offset`` that read ``got`` bytes short of them
    all (`pread_exact` each rest: `FileSizeError` where the file ends first)."""
    for part in parts:
        n = part.nbytes
        if got < n:
            pread_exact(fd, part[max(got, 0) :], offset + max(got, 0), preadv)
        offset += n
        got -= n
