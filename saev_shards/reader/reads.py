"""The copying read paths of `Shards`: ``pread`` into caller buffers, no memmaps.

Each path comes three ways. The ``_raw`` methods copy the stored values (the bytes of the
shard files: float8_e4m3 values as ml_dtypes' float8_e4m3fn, bfloat16 as uint16 bits);
the ``_scales`` methods copy a float8_e4m3 cache's float32 scales, one per vector, from its
scale files (offset arithmetic of protocol.md 4: the scale of the vector at
``offset_in_vectors`` is at byte ``offset_in_vectors * 4``); the plain methods return
values in the caller's dtype: dequantized for float8_e4m3 (float16 by default,
`Shards.read_dtype`), the stored values otherwise unless another dtype is asked for.

`read_example_raw` reads one ``(example, layer)`` slice (one ``preadv`` into a reused buffer;
keep its common case free of calls; a layer selection's loaders read a span's slices at once,
`slices.SliceReads`, after `prefetch_slices` hints them to the storage), `read_range_raw`
streams whole examples (one sequential ``pread`` per shard touched), `read_vectors_raw` gathers
single vectors in file order, coalescing neighbours into one ``preadv``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs import dtypes
from ..errors import FileSizeError, ScaleError
from ..fileio import pread_exact
from ..protocol import layout
from ..protocol.common import FLOAT8, SCALES_DTYPE
from ..protocol.float8 import NAN_BYTE, SCALE_RULE, describe_scale, odd_scales, scales_plain
from .handles import ShardHandles
from .indexing import CACHE_RANGE, wrap_index

#: Buffers one preadv call may take (Linux's IOV_MAX).
_IOV_MAX = 1024


class RawReads(ShardHandles):
    """The stored values, copied with ``pread`` (the loaders' hot path, the shuffle, benchmarks)."""

    shape: tuple[int, int, int, int]
    n_examples: int
    examples_per_shard: int
    dtype: str
    read_dtype: str
    _slice_nbytes: int

    # -- the stored values -------------------------------------------------------------------
    def read_example_raw(self, example: int, layer_idx: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy the stored values of ``[example, layer_idx]`` ``(T, D)`` into ``out`` with one ``pread``.

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
            fd = self.shard_fd(k)
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

    def prefetch_slices(self, start: int, stop: int, positions: Sequence[int]) -> None:
        """Hint that the ``(example, layer)`` slices at layer ``positions`` of examples
        ``[start, stop)`` are about to be read one by one (a layer selection: a strided walk,
        one slice of every ``L`` in each file). The storage has each run of neighbouring
        slices start reading now (`Files.prefetch`, scattered: POSIX_FADV_WILLNEED on a local
        cache), so the disk has every slice of the span in flight at once instead of one
        ``pread`` per read thread: the kernel's readahead does not follow a strided walk."""
        md = self.metadata
        nbytes, n_layers, eps = self._slice_nbytes, md.n_layers, self.examples_per_shard
        ordered = sorted({int(p) for p in positions})
        runs: list[tuple[int, int]] = []  # (first position, slices) of neighbouring positions
        for p in ordered:
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((p, 1))
        prefetch = self.files.prefetch
        e, stop = max(0, start), min(stop, self.n_examples)
        while e < stop:  # a span is inside one shard: one descriptor
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            fd = self.shard_fd(k)
            for i in range(local, local + count):
                for p, n in runs:
                    offset = (i * n_layers + p) * nbytes
                    prefetch(fd, offset, offset + n * nbytes, scattered=True)
            e += count

    def read_range_raw(self, start: int, stop: int, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Copy the stored values of examples ``[start, stop)`` ``(stop - start, L, T, D)`` into
        ``out``: one large sequential ``pread`` per shard touched (the fast path for streaming readers)."""
        md = self.metadata
        if not 0 <= start <= stop <= self.n_examples:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n_examples}]")
        if out is None:
            out = np.empty((stop - start, *md.shard_shape[1:]), self.numpy_dtype)
        if out.shape != (stop - start, *md.shard_shape[1:]) or out.dtype != self.numpy_dtype:
            raise ValueError(f"out must have shape {(stop - start, *md.shard_shape[1:])} and dtype {self.numpy_dtype}")
        self._read_examples_into(start, stop, out, md.example_nbytes, self.shard_fd)
        return out

    def _read_examples_into(
        self, start: int, stop: int, out: npt.NDArray[Any], example_nbytes: int, fd_of: Callable[[int], int]
    ) -> None:
        """Examples ``[start, stop)`` of the files ``fd_of(k)`` (``example_nbytes`` each) into ``out``."""
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        view = out.reshape(-1).view(np.uint8).data
        eps = self.examples_per_shard
        e = start
        pos = 0
        while e < stop:
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            nbytes = count * example_nbytes
            pread_exact(fd_of(k), view[pos : pos + nbytes], local * example_nbytes, self._preadv)
            pos += nbytes
            e += count

    def read_vectors_raw(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        tokens: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
    ) -> npt.NDArray[Any]:
        """Copy the stored values of the ``(n, D)`` vectors ``[examples[j], layer_idx[j], tokens[j]]``
        (positions, broadcast).

        Reads go in file order (sorted by shard and offset), and vectors that sit next to
        each other in a file are fetched by one ``preadv`` scattering into their rows. From a
        cold cache this reads only the bytes asked for, where memmap indexing pulls in a
        whole readahead window per vector.
        """
        md = self.metadata
        ex, li, tok = self._vector_coordinates(examples, layer_idx, tokens)
        n = ex.size
        if out is None:
            out = np.empty((n, md.d_model), self.numpy_dtype)
        if out.shape != (n, md.d_model) or out.dtype != self.numpy_dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.numpy_dtype} array of shape {(n, md.d_model)}")
        self._gather_rows(ex, li, tok, out, md.d_model, md.itemsize, self.shard_fd, self.shard_path)
        return out

    def _vector_coordinates(
        self, examples: npt.ArrayLike, layer_idx: npt.ArrayLike, tokens: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        md = self.metadata
        ex, li, tok = (np.asarray(a, dtype=np.int64) for a in np.broadcast_arrays(examples, layer_idx, tokens))
        ex, li, tok = ex.reshape(-1), li.reshape(-1), tok.reshape(-1)
        for name, values, size in (
            ("example", ex, md.n_examples),
            ("layer index", li, md.n_layers),
            ("token", tok, md.tokens_per_ex),
        ):
            if values.size and (values.min() < 0 or values.max() >= size):
                bad = values[(values < 0) | (values >= size)][0]
                raise IndexError(f"{name} {bad} out of range [0, {size})")
        return ex, li, tok

    def _gather_rows(
        self,
        ex: npt.NDArray[np.int64],
        li: npt.NDArray[np.int64],
        tok: npt.NDArray[np.int64],
        out: npt.NDArray[Any],
        row_values: int,
        itemsize: int,
        fd_of: Callable[[int], int],
        path_of: Callable[[int], Path],
    ) -> None:
        """Rows of ``row_values`` values of ``itemsize`` bytes, one per vector, from the files
        ``fd_of(k)``, into the rows of ``out``: in file order, neighbours in one ``preadv``."""
        md = self.metadata
        n = ex.size
        if n == 0:
            return
        shard, offset = layout.locate_many(
            ex, li, tok, examples_per_shard=md.examples_per_shard, n_layers=md.n_layers, tokens=md.tokens_per_ex,
            vector_nbytes=row_values * itemsize,
        )  # fmt: skip
        vec = row_values * itemsize
        order = np.lexsort((offset, shard))
        s_sorted, o_sorted = shard[order], offset[order]
        # A new run starts where the shard changes or the next vector is not adjacent in the file.
        starts = np.flatnonzero(np.r_[True, (np.diff(s_sorted) != 0) | (np.diff(o_sorted) != vec)])
        ends = np.r_[starts[1:], n]
        rows = out.reshape(n, -1).view(np.uint8)
        row_views = [memoryview(rows[j]) for j in order.tolist()]
        for a, b, k, off in zip(
            starts.tolist(), ends.tolist(), s_sorted[starts].tolist(), o_sorted[starts].tolist(), strict=True
        ):
            fd = fd_of(k)
            for c in range(a, b, _IOV_MAX):
                part = row_views[c : min(b, c + _IOV_MAX)]
                got = self._preadv(fd, part, off + (c - a) * vec)
                if got != len(part) * vec:
                    raise FileSizeError(f"{path_of(k)}: short read at byte {off} (file truncated after open?)")


class ScaleReads(RawReads):
    """A float8_e4m3 cache's float32 scales, copied with ``pread``, and what a scale file may hold."""

    # -- the scales of a float8_e4m3 cache -----------------------------------------------------
    def read_example_scales(
        self, example: int, layer_idx: int, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """Copy the ``(T,)`` float32 scales of ``[example, layer_idx]`` into ``out`` (one ``pread``)."""
        example = wrap_index(int(example), self.n_examples, "example", CACHE_RANGE)
        n_layers, tokens = self.shape[1], self.shape[2]
        if not 0 <= layer_idx < n_layers:
            raise IndexError(f"layer index {layer_idx} out of range [0, {n_layers})")
        out = self._scales_out(out, (tokens,))
        k, i = divmod(example, self.examples_per_shard)
        nbytes = tokens * SCALES_DTYPE.itemsize
        pread_exact(self.scale_fd(k), out.view(np.uint8).data, (i * n_layers + layer_idx) * nbytes, self._preadv)
        if not scales_plain(out):
            self.check_scales(out, lambda: (example * n_layers + layer_idx) * tokens + np.arange(tokens))
        return out

    def read_range_scales(
        self, start: int, stop: int, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """Copy the float32 scales of examples ``[start, stop)`` ``(stop - start, L, T)`` into ``out``."""
        md = self.metadata
        if not 0 <= start <= stop <= self.n_examples:
            raise IndexError(f"range [{start}, {stop}) is not within [0, {self.n_examples}]")
        out = self._scales_out(out, (stop - start, md.n_layers, md.tokens_per_ex))
        per_example = md.n_layers * md.tokens_per_ex
        self._read_examples_into(start, stop, out, per_example * SCALES_DTYPE.itemsize, self.scale_fd)
        if not scales_plain(out):
            self.check_scales(out, lambda: np.arange(start * per_example, stop * per_example).reshape(out.shape))
        return out

    def read_vectors_scales(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        tokens: npt.ArrayLike,
        out: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]:
        """Copy the ``(n,)`` float32 scales of the vectors of `read_vectors_raw`, in file order."""
        ex, li, tok = self._vector_coordinates(examples, layer_idx, tokens)
        out = self._scales_out(out, (ex.size,))
        self._gather_rows(ex, li, tok, out, 1, SCALES_DTYPE.itemsize, self.scale_fd, self.scale_path)
        if not scales_plain(out):
            self.check_scales(out, lambda: (ex * self.shape[1] + li) * self.shape[2] + tok)
        return out

    # -- what a scale file may hold (protocol.md 5) --------------------------------------------
    def check_scales(self, scales: npt.NDArray[Any], vectors: Callable[[], npt.ArrayLike]) -> None:
        """`ScaleError` naming the scale file, the vector and the scale, for the first scale in
        ``scales`` (float32, read from this cache) that the scale rule cannot give; nothing
        when all are valid. ``vectors()`` numbers each scale's vector, ``(example * L +
        layer_idx) * T + token`` (of ``scales``' shape, or broadcast to it). A NaN scale is
        valid only for a vector stored as NaN: the bytes of those vectors are read, and must
        all be 0x7F. Every read of scales calls this, once `scales_plain` (one maximum
        over their bits) has found something else than plain scales."""
        found = self.scale_problems(scales, vectors)
        if found:
            more = f"; {len(found) - 1} more in what was read" if len(found) > 1 else ""
            raise ScaleError(f"{found[0][1]}{more} (`saev-shards verify` lists them all)")

    def scale_problems(self, scales: npt.NDArray[Any], vectors: Callable[[], npt.ArrayLike]) -> list[tuple[int, str]]:
        """``(vector number, message)`` of each vector among ``scales`` whose scale the rule
        cannot give (see `check_scales`), by vector number."""
        if scales_plain(scales):
            return []
        flat = np.asarray(scales, np.float32).reshape(-1)
        odd, nan = odd_scales(flat)
        ids = np.broadcast_to(np.asarray(vectors(), np.int64), np.shape(scales)).reshape(-1)
        found: dict[int, str] = {}
        for j in odd[np.unique(ids[odd], return_index=True)[1]].tolist():
            found[int(ids[j])] = f"scale {describe_scale(flat[j])}: {SCALE_RULE}"
        if nan.size:  # stored as NaN? Then every byte of the vector is 0x7F (rule 2)
            numbers = np.unique(ids[nan])
            n_layers, tokens = self.shape[1], self.shape[2]
            ex, rest = np.divmod(numbers, n_layers * tokens)
            bytes_ = self.read_vectors_raw(ex, rest // tokens, rest % tokens).view(np.uint8)
            for number in numbers[~(bytes_ == NAN_BYTE).all(axis=1)].tolist():
                found.setdefault(
                    int(number),
                    "scale NaN 0x7fc00000, the scale of a vector stored as NaN, but the vector's bytes are not all "
                    "0x7f (protocol.md 5)",
                )
        return [(number, f"{self.scale_vector_name(number)}: {message}") for number, message in sorted(found.items())]

    def scale_vector_name(self, number: int) -> str:
        """Where vector ``number`` (``(example * L + layer_idx) * T + token``) has its scale:
        ``"<scale file>: vector 17 (example 3, layer 11, token 2)"``."""
        md = self.metadata
        n_layers, tokens = self.shape[1], self.shape[2]
        example, rest = divmod(int(number), n_layers * tokens)
        layer_idx, token = divmod(rest, tokens)
        k, i = divmod(example, self.examples_per_shard)
        scales = self.manifest.scales
        where = self.files.where(scales.names[k]) if scales is not None else str(self.path)
        return (
            f"{where}: vector {(i * n_layers + layer_idx) * tokens + token} (example {example}, layer "
            f"{md.layers[layer_idx]}, token {token})"
        )

    def _scales_out(self, out: npt.NDArray[Any] | None, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        if self.metadata.dtype != FLOAT8:
            raise ValueError(f"{self.path}: a {self.metadata.dtype} cache has no scales (float8_e4m3 caches have)")
        if out is None:
            return np.empty(shape, SCALES_DTYPE)
        if out.shape != shape or out.dtype != SCALES_DTYPE or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous float32 array of shape {shape}, found {out.dtype} {out.shape}"
            )
        return out


class ReadPaths(ScaleReads):
    """Fast copying reads (pread; used by loaders, the shuffle and benchmarks): the stored
    values (`RawReads`), the scales (`ScaleReads`), and values in the caller's dtype (here)."""

    # -- values in the caller's dtype ------------------------------------------------------
    def read_example(
        self, example: int, layer_idx: int, out: npt.NDArray[Any] | None = None, *, dtype: str | None = None
    ) -> npt.NDArray[Any]:
        """Copy ``[example, layer_idx]`` ``(T, D)`` into ``out``, in ``out``'s dtype, else
        ``dtype``, else `read_dtype` (float8_e4m3 dequantized: one ``pread`` of the values and
        one of their ``T`` scales). ``layer_idx`` is a position in ``metadata.layers``."""
        want = self._want(out, dtype)
        if want == self.dtype:
            return self.read_example_raw(example, layer_idx, out)
        raw = self.read_example_raw(example, layer_idx, np.empty(self.shape[2:], self.numpy_dtype))
        scales = self.read_example_scales(example, layer_idx) if self.dtype == FLOAT8 else None
        return dtypes.convert(raw, self.dtype, want, scales, out)

    def read_range(
        self, start: int, stop: int, out: npt.NDArray[Any] | None = None, *, dtype: str | None = None
    ) -> npt.NDArray[Any]:
        """Copy examples ``[start, stop)`` ``(stop - start, L, T, D)`` into ``out``, in the dtype
        chosen as for `read_example`."""
        want = self._want(out, dtype)
        if want == self.dtype:
            return self.read_range_raw(start, stop, out)
        raw = self.read_range_raw(start, stop)
        scales = self.read_range_scales(start, stop) if self.dtype == FLOAT8 else None
        return dtypes.convert(raw, self.dtype, want, scales, out)

    def read_vectors(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        tokens: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
        *,
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        """Copy the ``(n, D)`` vectors ``[examples[j], layer_idx[j], tokens[j]]`` (positions,
        broadcast) into ``out``, in the dtype chosen as for `read_example`; see `read_vectors_raw`."""
        want = self._want(out, dtype)
        if want == self.dtype:
            return self.read_vectors_raw(examples, layer_idx, tokens, out)
        raw = self.read_vectors_raw(examples, layer_idx, tokens)
        scales = self.read_vectors_scales(examples, layer_idx, tokens) if self.dtype == FLOAT8 else None
        return dtypes.convert(raw, self.dtype, want, scales, out)

    def read_examples(
        self,
        examples: npt.ArrayLike,
        layer_idx: npt.ArrayLike,
        out: npt.NDArray[Any] | None = None,
        *,
        dtype: str | None = None,
    ) -> npt.NDArray[Any]:
        """Copy ``(n, T, D)`` slices for pairs ``(examples[j], layer_idx[j])`` (positions), in the
        dtype chosen as for `read_example`."""
        ex = np.asarray(examples, dtype=np.int64).reshape(-1)
        li = np.broadcast_to(np.asarray(layer_idx, dtype=np.int64), ex.shape)
        md = self.metadata
        want = self._want(out, dtype)
        if out is None:
            out = np.empty(
                (len(ex), *md.shard_shape[2:]), self.numpy_dtype if want == self.dtype else dtypes.READ_DTYPES[want]
            )
        for j in range(len(ex)):
            self.read_example(int(ex[j]), int(li[j]), out[j], dtype=want)
        return out

    def _want(self, out: npt.NDArray[Any] | None, dtype: str | None) -> str:
        """The dtype name a read returns: ``out``'s, else ``dtype``, else `read_dtype`."""
        if out is not None:
            if out.dtype == self.numpy_dtype:
                return self.dtype
            for name, np_dtype in dtypes.READ_DTYPES.items():
                if out.dtype == np_dtype:
                    return name
            raise ValueError(
                f"out: expected a {self.numpy_dtype} array (the stored values) or one of "
                f"{[str(d) for d in dtypes.READ_DTYPES.values()]}, found {out.dtype}"
            )
        if dtype is None:
            return self.read_dtype
        return check_read_dtype(self.dtype, dtype)


def check_read_dtype(stored: str, dtype: object) -> str:
    """``dtype`` if a cache of ``stored`` values can be read as it: the stored dtype itself
    (except float8_e4m3, whose values are useless without their scales: `Shards.raw`), or one
    of float16, float32, bfloat16 (uint16 bits)."""
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, np.dtype) else dtype.name
    if name in dtypes.READ_DTYPES or (name == stored and stored != FLOAT8):
        return name
    raise ValueError(
        f"dtype: expected one of {list(dtypes.READ_DTYPES)} for a {stored} cache, found {dtype!r}"
        + ("; the stored values and their scales are Shards.raw and Shards.scales" if stored == FLOAT8 else "")
    )
