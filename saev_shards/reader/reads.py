"""The copying read paths of `Shards`: ``pread`` into caller buffers, no memmaps.

Every read goes through the cache's storage (`ShardHandles.files`): ``os.preadv`` on
descriptors for a local cache, verified ranged reads for a remote one (`remote.files`).

`read_example` is the loaders' hot path (one ``preadv`` per ``(example, layer)`` slice into
a reused buffer; keep its common case free of calls), `read_range` streams whole examples
(one sequential ``pread`` per shard touched), `read_vectors` gathers single vectors in
file order, coalescing neighbours into one ``preadv``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import layout
from .._indexing import CACHE_RANGE, wrap_index
from ..errors import FileSizeError
from ..fileio import pread_exact
from .handles import ShardHandles

#: Buffers one preadv call may take (Linux's IOV_MAX).
_IOV_MAX = 1024


class ReadPaths(ShardHandles):
    """Fast copying reads (pread; used by loaders, the shuffle and benchmarks)."""

    shape: tuple[int, int, int, int]
    n_examples: int
    examples_per_shard: int
    _slice_nbytes: int

    def read_example(self, example: int, layer_idx: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy ``[example, layer_idx]`` ``(T, D)`` into ``out`` with one ``pread``.

        ``layer_idx`` is a position in ``metadata.layers``. Reusing one ``out`` buffer is
        the fast path (its byte view is kept between calls).
        """
        if not 0 <= example < self.n_examples:  # the common case costs one comparison
            example = wrap_index(example, self.n_examples, "example", CACHE_RANGE)
        n_layers = self.shape[1]
        if not 0 <= layer_idx < n_layers:
            raise IndexError(f"layer index {layer_idx} out of range [0, {n_layers})")
        if out is None:
            out = np.empty(self.shape[2:], self.numpy_dtype)
        cached = self._out_cache  # one attribute read: threads never pair a buffer with another's view
        view = cached[1] if cached is not None and cached[0] is out else self._byte_view_of(out)
        k, i = divmod(example, self.examples_per_shard)
        fd = self._fds.get(k) if self._pid == os.getpid() else None
        if fd is None:
            fd = self._fd(k)
        nbytes = self._slice_nbytes
        if self._preadv(fd, [view], (i * n_layers + layer_idx) * nbytes) != nbytes:
            pread_exact(fd, view, (i * n_layers + layer_idx) * nbytes, self._preadv)  # a short read: finish it
        return out

    def _byte_view_of(self, out: npt.NDArray[Any]) -> memoryview:
        if not out.flags.c_contiguous or out.dtype != self.numpy_dtype or out.nbytes != self._slice_nbytes:
            raise ValueError(
                f"out must be a C-contiguous {self.numpy_dtype} array of {self._slice_nbytes} bytes "
                f"(shape {self.shape[2:]}), found {out.dtype} {out.shape}"
            )
        view = out.reshape(-1).view(np.uint8).data
        self._out_cache = (out, view)
        return view

    def read_range(self, start: int, stop: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy examples ``[start, stop)`` ``(stop - start, L, T, D)`` into ``out``: one large
        sequential ``pread`` per shard touched (the fast path for streaming readers)."""
        md = self.metadata
        if not 0 <= start <= stop <= self.n_examples:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n_examples}]")
        if out is None:
            out = np.empty((stop - start, *md.shard_shape[1:]), self.numpy_dtype)
        if out.shape != (stop - start, *md.shard_shape[1:]) or out.dtype != self.numpy_dtype:
            raise ValueError(f"out must have shape {(stop - start, *md.shard_shape[1:])} and dtype {self.numpy_dtype}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        view = out.reshape(-1).view(np.uint8).data
        eps, example_nbytes = md.examples_per_shard, md.example_nbytes
        e = start
        pos = 0
        while e < stop:
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            nbytes = count * example_nbytes
            pread_exact(self._fd(k), view[pos : pos + nbytes], local * example_nbytes, self._preadv)
            pos += nbytes
            e += count
        return out

    def read_vectors(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        tokens: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
    ) -> npt.NDArray[Any]:
        """Copy the ``(n, D)`` vectors ``[examples[j], layer_idx[j], tokens[j]]`` (positions, broadcast).

        Reads go in file order (sorted by shard and offset), and vectors that sit next to
        each other in a file are fetched by one ``preadv`` scattering into their rows. From a
        cold cache this reads only the bytes asked for, where memmap indexing pulls in a
        whole readahead window per vector.
        """
        md = self.metadata
        ex, li, tok = (np.asarray(a, dtype=np.int64) for a in np.broadcast_arrays(examples, layer_idx, tokens))
        ex, li, tok = ex.reshape(-1), li.reshape(-1), tok.reshape(-1)
        n = ex.size
        for name, values, size in (
            ("example", ex, md.n_examples),
            ("layer index", li, md.n_layers),
            ("token", tok, md.tokens_per_ex),
        ):
            if n and (values.min() < 0 or values.max() >= size):
                bad = values[(values < 0) | (values >= size)][0]
                raise IndexError(f"{name} {bad} out of range [0, {size})")
        if out is None:
            out = np.empty((n, md.d_model), self.numpy_dtype)
        if out.shape != (n, md.d_model) or out.dtype != self.numpy_dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.numpy_dtype} array of shape {(n, md.d_model)}")
        if n == 0:
            return out
        shard, offset = layout.locate_many(
            ex, li, tok, eps=md.examples_per_shard, n_layers=md.n_layers, tokens=md.tokens_per_ex,
            d_model=md.d_model, itemsize=md.itemsize,
        )  # fmt: skip
        vec = md.d_model * md.itemsize
        order = np.lexsort((offset, shard))
        s_sorted, o_sorted = shard[order], offset[order]
        # A new run starts where the shard changes or the next vector is not adjacent in the file.
        starts = np.flatnonzero(np.r_[True, (np.diff(s_sorted) != 0) | (np.diff(o_sorted) != vec)])
        ends = np.r_[starts[1:], n]
        rows = out.reshape(n, -1).view(np.uint8)
        row_views = [memoryview(rows[j]) for j in order.tolist()]
        preadv = self._preadv
        for a, b, k, off in zip(
            starts.tolist(), ends.tolist(), s_sorted[starts].tolist(), o_sorted[starts].tolist(), strict=True
        ):
            fd = self._fd(k)
            for c in range(a, b, _IOV_MAX):
                part = row_views[c : min(b, c + _IOV_MAX)]
                got = preadv(fd, part, off + (c - a) * vec)
                if got != len(part) * vec:
                    where = self.files.where(self.manifest.shards[k].name)
                    raise FileSizeError(f"{where}: short read at byte {off} (file truncated after open?)")
        return out

    def read_examples(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
    ) -> npt.NDArray[Any]:
        """Copy ``(n, T, D)`` slices for pairs ``(examples[j], layer_idx[j])`` (positions)."""
        ex = np.asarray(examples, dtype=np.int64).reshape(-1)
        li = np.broadcast_to(np.asarray(layer_idx, dtype=np.int64), ex.shape)
        md = self.metadata
        if out is None:
            out = np.empty((len(ex), *md.shard_shape[2:]), self.numpy_dtype)
        for j in range(len(ex)):
            self.read_example(int(ex[j]), int(li[j]), out[j])
        return out
