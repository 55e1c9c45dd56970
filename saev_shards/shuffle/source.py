"""What a shuffle reads from its source: the chosen tokens, and the rows beside them.

Everything is read with ``pread`` into buffers the caller owns, never through memmaps:
pages a memmap touches stay resident and would count against the memory budget
(``labels.bin`` of an ImageNet cache alone is 250 MB).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..fileio import pread_exact
from ..protocol.common import FLOAT8
from ..reader import Shards
from ..selection import TOKEN_CHOICES, Selection

__all__ = [
    "MIN_HINTED_SLICE",
    "MIN_SLICE_READ",
    "READ_THREADS",
    "SCAN_EXAMPLES",
    "TOKEN_CHOICES",
    "Selection",
    "SourceReader",
    "per_token_columns",
]

#: Bytes of one (example, layer) slice from which a proper subset of the layers is read slice
#: by slice rather than as whole examples, on any storage (the loaders' `plan.MIN_SLICE_READ`).
MIN_SLICE_READ = 128 << 10
#: The same on a local cache, where the slices are hinted before they are read
#: (`Shards.prefetch_slices`, POSIX_FADV_WILLNEED): the disk then reads only the chosen layers'
#: bytes, all of a part's slices in flight at once (the loaders' `windows.MIN_HINTED_SLICE`).
#: Smaller slices cost more in requests than reading whole examples does; a remote cache
#: fetches its blocks whole anyway.
MIN_HINTED_SLICE = 16 << 10
#: Requests in flight when the shuffle reads the source and its runs (the loaders' default):
#: the development machine's disk serves 1.3-1.5 x more than with one at a time.
READ_THREADS = 4
#: Examples per step when a per-example column is scanned (bounds the scan's memory).
SCAN_EXAMPLES = 1 << 16


def per_token_columns(shards: Shards) -> dict[str, np.dtype[Any]]:
    """Source columns with one value per token position (shape ``(n_examples, T)``), by name.

    Their value at each chosen token is carried into the shuffled cache (``token_ids``).
    """
    md = shards.metadata
    return {
        name: np.dtype(entry.dtype)
        for name, entry in sorted(shards.manifest.columns.items())
        if tuple(entry.shape) == (md.n_examples, md.tokens_per_ex)
    }


class SourceReader:
    """Reads examples ``[start, stop)`` of the source: chosen layers, labels, lengths, columns."""

    def __init__(self, shards: Shards, selection: Selection) -> None:
        md = shards.metadata
        self.shards = shards
        self.selection = selection
        self.n_layers = len(selection.layer_positions)
        self.tokens_per_ex = md.tokens_per_ex
        self.d_model = md.d_model
        self.dtype = shards.numpy_dtype
        slice_nbytes = md.tokens_per_ex * md.d_model * md.itemsize
        local = not shards.files.prefetches
        #: Whole examples are read when every layer is chosen or slices are small, else the
        #: chosen layers' slices alone (`MIN_SLICE_READ`, `MIN_HINTED_SLICE`).
        self.whole = self.n_layers == md.n_layers or (
            slice_nbytes < MIN_SLICE_READ and not (local and slice_nbytes >= MIN_HINTED_SLICE)
        )
        #: Whether a part's slices are hinted to the storage before they are read.
        self.hint = not self.whole and local
        self.layer_positions = np.array(selection.layer_positions, dtype=np.int64)
        #: ``(first row, first position, count)`` of each run of chosen layers that are neighbours
        #: both in the files and in a read buffer: one ``pread`` per run and example.
        self.slice_runs: list[tuple[int, int, int]] = []
        for row, position in enumerate(self.layer_positions.tolist()):
            last = self.slice_runs[-1] if self.slice_runs else None
            if last is not None and last[0] + last[2] == row and last[1] + last[2] == position:
                self.slice_runs[-1] = (last[0], last[1], last[2] + 1)
            else:
                self.slice_runs.append((row, position, 1))
        #: Bytes of one example as held in a read buffer.
        self.example_nbytes = (md.n_layers if self.whole else self.n_layers) * slice_nbytes
        #: A float8_e4m3 source: bytes of one example's scales as read beside it (else 0).
        self.float8 = md.dtype == FLOAT8
        self.scales_nbytes = (md.n_layers if self.whole else self.n_layers) * md.tokens_per_ex * 4 if self.float8 else 0

    def acts(self, start: int, stop: int, buffer: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
        """Examples ``[start, stop)`` as ``(n, rows, T, D)`` in ``buffer`` (all layers when
        read whole, else the chosen ones); `layer_rows` says which rows are the chosen layers."""
        n = stop - start
        rows = self.shards.metadata.n_layers if self.whole else self.n_layers
        out = buffer[: n * self.example_nbytes].view(self.dtype).reshape(n, rows, self.tokens_per_ex, self.d_model)
        # READ_THREADS parts read at once: this kind of disk serves more with several requests in flight.
        bounds = np.linspace(0, n, min(n, READ_THREADS) + 1).astype(np.int64).tolist()
        parts = list(itertools.pairwise(bounds))

        def read(part: tuple[int, int]) -> None:
            a, b = part
            if self.whole:
                self.shards.read_range(start + a, start + b, out[a:b])
            else:
                self._read_slices(start + a, start + b, out[a:b])

        with ThreadPoolExecutor(max(1, len(parts)), "saev-shuffle-source") as pool:
            list(pool.map(read, parts))
        return out

    def _read_slices(self, start: int, stop: int, out: npt.NDArray[Any]) -> None:
        """The chosen ``(example, layer)`` slices of examples ``[start, stop)``, hinted first on a
        local cache (`hint`), then one ``pread`` per run of neighbouring chosen layers
        (`slice_runs`) and example, through descriptors of our own (`Shards.read_example`
        keeps its last output buffer referenced, which would pin a whole read buffer beyond
        the scatter pass)."""
        if self.hint:
            self.shards.prefetch_slices(start, stop, self.layer_positions.tolist())
        layers = self.shards.metadata.layers
        files = self.shards.files  # local descriptors, or a remote cache's verified reads
        fds: dict[int, int] = {}
        try:
            for j in range(stop - start):
                for row, position, count in self.slice_runs:
                    shard, offset = self.shards.locate(start + j, layers[position], 0)
                    fd = fds.get(shard)
                    if fd is None:
                        fd = fds[shard] = files.open(self.shards.manifest.shards[shard].name)
                    view = out[j, row : row + count].reshape(-1).view(np.uint8).data
                    pread_exact(fd, view, offset, files.preadv)
        finally:
            for fd in fds.values():
                files.close(fd)

    def scales(self, start: int, stop: int) -> npt.NDArray[np.float32] | None:
        """A float8_e4m3 source's scales of examples ``[start, stop)`` as ``(n, rows, T)``, rows as
        in `acts`; None for another dtype."""
        if not self.float8:
            return None
        if self.whole:
            return self.shards.read_range_scales(start, stop)
        md = self.shards.metadata
        out = np.empty((stop - start, self.n_layers, md.tokens_per_ex), np.float32)
        for j in range(stop - start):
            for r, position in enumerate(self.layer_positions.tolist()):
                self.shards.read_example_scales(start + j, position, out[j, r])
        return out

    @property
    def layer_rows(self) -> npt.NDArray[np.int64]:
        """Rows of a read buffer's example that hold the chosen layers, in order."""
        return self.layer_positions if self.whole else np.arange(self.n_layers, dtype=np.int64)

    def _array(self, name: str, dtype: np.dtype[Any], tail: tuple[int, ...], start: int, stop: int) -> npt.NDArray[Any]:
        row = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        out = np.empty((stop - start, *tail), dtype)
        if out.nbytes:
            files = self.shards.files
            fd = files.open(name)
            try:
                pread_exact(fd, out.reshape(-1).view(np.uint8).data, start * row, files.preadv)
            finally:
                files.close(fd)
        return out

    def lengths(self, start: int, stop: int) -> npt.NDArray[np.int64] | None:
        """The ``lengths`` column of examples ``[start, stop)`` (int64), or None without one."""
        entry = self.shards.manifest.columns.get("lengths")
        if entry is None:
            return None
        return self._array(entry.name, np.dtype(entry.dtype), (), start, stop).astype(np.int64)

    def labels(self, start: int, stop: int) -> npt.NDArray[np.uint8] | None:
        """``labels.bin`` rows ``(n, patches_per_ex)`` of examples ``[start, stop)``, or None."""
        entry = self.shards.manifest.labels
        if entry is None:
            return None
        return self._array(entry.name, np.dtype(np.uint8), (self.shards.metadata.patches_per_ex,), start, stop)

    def column(self, name: str, start: int, stop: int) -> npt.NDArray[Any]:
        """Per-token column ``name`` ``(n, T)`` of examples ``[start, stop)``."""
        entry = self.shards.manifest.columns[name]
        return self._array(entry.name, np.dtype(entry.dtype), (self.tokens_per_ex,), start, stop)

    def mask(self, lengths: npt.NDArray[np.int64] | None, n: int, start: int = 0) -> npt.NDArray[np.bool_]:
        """``(n, T)``: the chosen positions of examples ``[start, start + n)`` (padding and what
        the token masks drop removed)."""
        return self._masks(lengths, n, start)[0]

    def _masks(
        self, lengths: npt.NDArray[np.int64] | None, n: int, start: int
    ) -> tuple[npt.NDArray[np.bool_], dict[str, int]]:
        """The chosen positions, and how many positions each token mask took from the rest (`Selection.mask`)."""
        examples = np.arange(start, start + n, dtype=np.int64)
        mask, taken = self.selection.mask(
            examples, lengths=lengths, token_ids=lambda: self.column("token_ids", start, start + n)
        )
        return mask, {name: int(hit.sum()) for name, hit in taken.items()}

    def count(self, start: int, stop: int) -> int:
        """Chosen tokens of examples ``[start, stop)`` (one layer), reading only ``lengths``
        (and ``token_ids`` with `exclude_token_ids`)."""
        return self.count_and_dropped(start, stop)[0]

    def count_and_dropped(self, start: int, stop: int) -> tuple[int, dict[str, int]]:
        """`count`, and the positions each token mask dropped from examples ``[start, stop)``."""
        sel = self.selection
        if not sel.varies:
            return (stop - start) * sel.per_example, {}
        positions = np.array(sel.positions, dtype=np.int64)
        total = 0
        dropped: dict[str, int] = {}
        for a in range(start, stop, SCAN_EXAMPLES):
            b = min(stop, a + SCAN_EXAMPLES)
            lengths = self.lengths(a, b)
            if not sel.masked:
                assert lengths is not None
                total += int(np.searchsorted(positions, lengths, side="left").sum())
                continue
            mask, taken = self._masks(lengths, b - a, a)
            total += int(mask.sum())
            for name, k in taken.items():
                dropped[name] = dropped.get(name, 0) + k
        return total, dropped
