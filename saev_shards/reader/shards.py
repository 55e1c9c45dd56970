"""`Shards`: an open cache, the logical ``(N, L, T, D)`` tensor and everything beside it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs.dtypes import convert, to_float32
from ..errors import (
    LayerIndexError,
    NameNotFoundError,
)
from ..protocol import layout
from ..protocol.common import FLOAT8, SCALES_DTYPE
from ..protocol.float8 import scales_plain
from ..protocol.jsonfile import is_int, short_repr
from ..protocol.manifest import BlockDigests, Manifest
from ..protocol.metadata import Metadata
from ..protocol.v31 import load_blocks
from ..storage.base import Files
from ..storage.local import LocalFiles
from .indexing import CACHE_RANGE, getitem, wrap_index
from .reads import ReadPaths, check_read_dtype
from .sidecars import Sidecars
from .slices import SliceReads
from .summary import describe, summary_html, summary_rows


class Shards(ReadPaths, SliceReads, Sidecars):
    """An open cache: the logical tensor ``(n_examples, L, T, D)`` and everything beside it.

    Layers are named two ways, and each method says which it takes:

    * ``shards[i, j, t]`` indexes the logical tensor like a numpy array: ``j`` is a layer
      *position*, ``0..L-1`` in the order of ``metadata.layers``. A position out of range
      that is a recorded layer value raises `LayerIndexError` saying so.
    * `get`, `example`, `locate` and `layer_index` take layer *values* (the block numbers
      in ``metadata.layers``, e.g. 11); ``shards[:, shards.layer_index(11)]`` selects a
      layer by value in an index. `read_example` and `read_vectors` (the fast paths) take
      positions.

    Values come in `read_dtype`: the stored dtype, except for float8_e4m3 caches, whose values
    are dequantized (each times its vector's scale) into float16 by default; `with_dtype`
    gives the cache read as another dtype (``shards.with_dtype("float32")``), and the read
    methods take ``dtype=``. A float8_e4m3 vector whose values do not fit float16 raises
    `DtypeRangeError` rather than turning into infinities. The stored values and scales are
    `raw` and `scales` (``shards.raw[i]``, ``shards.scales[i]``), indexed like the cache.

    Stored values are read-only views into the memmapped shards whenever numpy would return
    a view, copies otherwise; dequantized and converted values are fresh arrays. bfloat16
    caches return raw uint16 bits; `to_float32` widens them. Per-example columns and text
    fields are mappings by name: ``shards.columns["lengths"]``, ``shards.text["prompt"]`` (`Fields`).

    Memmaps and file handles open lazily and per process: a pickled `Shards` carries no
    data and no handles, and a forked or unpickled copy opens its own.

    The class is a facade: handles and pickling are `handles.ShardHandles`, the ``pread``
    paths `reads.ReadPaths` (a span's slices at once `slices.SliceReads`), labels, columns,
    text and statistics `sidecars.Sidecars`, `verify` is `verify.verify`, the repr and the
    notebook table `summary`, the views `views` and the picture `report`; this module keeps
    the indexing of the logical tensor.
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        manifest: Manifest,
        read_dtype: str | None = None,
        files: Files | None = None,
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.manifest = manifest
        self.files = files if files is not None else LocalFiles(path)
        md = metadata
        self.shape = md.shape
        #: The stored dtype (metadata.json's), and the numpy dtype of its raw values.
        self.dtype = md.dtype
        self.numpy_dtype = md.numpy_dtype
        #: The dtype values are read as: float16 for float8_e4m3 caches, else the stored one (`with_dtype`).
        self.read_dtype = default_read_dtype(md.dtype) if read_dtype is None else check_read_dtype(md.dtype, read_dtype)
        self.n_examples = md.n_examples
        self.examples_per_shard = md.examples_per_shard
        self.n_shards = len(manifest.shards)
        self._layer_idx = {layer: i for i, layer in enumerate(md.layers)}
        self._slice_nbytes = md.tokens_per_ex * md.d_model * md.itemsize  # one (example, layer) slice
        self._reset()
        self._hold_folder()  # open: a shared lock on the folder until close() (handles.FolderLock)

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- notebook API --------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_examples

    def with_dtype(self, dtype: str | None) -> Shards:
        """This cache with its values read as ``dtype`` (``"float16"``, ``"float32"``, ``"bfloat16"``
        as uint16 bits; None: the default, `read_dtype`): a new `Shards` on the same files, which
        opens its own handles. ``ss.open(ref).with_dtype("float32")``."""
        return Shards(self.path, self.metadata, self.manifest, dtype, self.files)

    @property
    def raw(self) -> StoredValues:
        """The stored values, indexed like the cache (``shards.raw[i, layer, token]``): float8_e4m3
        as ml_dtypes' float8_e4m3fn (to be multiplied by `scales`), bfloat16 as uint16 bits."""
        return StoredValues(self)

    @property
    def scales(self) -> Scales | None:
        """A float8_e4m3 cache's float32 scales, one per vector, indexed like the logical
        ``(N, L, T)`` tensor of vectors (``shards.scales[i, layer]``); None for other dtypes."""
        return Scales(self) if self.dtype == FLOAT8 else None

    def _values(
        self,
        raw: npt.NDArray[Any],
        scales: Callable[[], npt.NDArray[Any]],
        dtype: str | None = None,
        vectors: Callable[[], npt.ArrayLike] | None = None,
    ) -> npt.NDArray[Any]:
        """Stored values as `read_dtype` (or ``dtype``); ``scales()`` gives the scales of each
        value's vector, broadcast to ``raw``'s shape, and ``vectors()`` the number of each
        value's vector (for `check_scales`; float8_e4m3 only)."""
        want = self.read_dtype if dtype is None else check_read_dtype(self.dtype, dtype)
        if self.dtype == FLOAT8:
            found = scales()
            if vectors is not None and not scales_plain(found):
                self.check_scales(found, vectors)
            return convert(raw, self.dtype, want, found, elementwise=True)
        return convert(raw, self.dtype, want)

    def __repr__(self) -> str:
        return describe(self)

    def summary_rows(self) -> list[tuple[str, str]]:
        """What a notebook shows of this cache (`_repr_html_`): one ``(name, value)`` per line."""
        return summary_rows(self)

    def _repr_html_(self) -> str:
        """A short table of the cache, for a notebook (``shards.report()`` draws its picture)."""
        return summary_html(self)

    @property
    def url(self) -> str | None:
        """The URL of a remote cache (``s3://bucket/root/<hash>``), None for a local one. A
        remote cache's `path` is the local folder that keeps its JSON files (`storage.remote_json`)."""
        return self.files.url

    @property
    def location(self) -> str:
        """Where the cache is, for messages: its URL, or its path."""
        return self.files.location

    def prefetch(self, start: int, stop: int) -> None:
        """Hint that examples ``[start, stop)`` are about to be read (the loaders call it for
        each window): a remote cache starts fetching their blocks in the background; a local
        float8_e4m3 cache has the kernel start reading their scales (POSIX_FADV_WILLNEED), as
        its readahead does not foresee a loader's small scattered scale reads, which would
        otherwise wait for the disk one after another; a local cache's values are left to the
        kernel's readahead (`Files.prefetch`: the storage decides what a hint is worth)."""
        md = self.metadata
        values, scales = self.files.prefetches, md.dtype == FLOAT8
        if not (values or scales) or stop <= start:
            return
        eps, example_nbytes = self.examples_per_shard, md.example_nbytes
        scale_nbytes = md.n_layers * md.tokens_per_ex * SCALES_DTYPE.itemsize
        e = max(0, start)
        stop = min(stop, self.n_examples)
        while e < stop:
            k, local = layout.shard_of(e, eps)
            count = min(stop, (k + 1) * eps) - e
            if values:
                self.files.prefetch(self.shard_fd(k), local * example_nbytes, (local + count) * example_nbytes)
            if scales:
                first, last = local * scale_nbytes, (local + count) * scale_nbytes
                self.files.prefetch(self.scale_fd(k), first, last, scattered=True)
            e += count

    def layer_index(self, layer: int) -> int:
        """Position (``0..L-1``) of layer *value* ``layer``; `NameNotFoundError` (a `KeyError`)
        naming the recorded layer values if absent."""
        try:
            return self._layer_idx[layer]
        except (KeyError, TypeError):
            layers = list(self.metadata.layers)
            hint = ""
            integer = is_int(layer, numpy_ok=True)
            if integer and -len(layers) <= layer < len(layers):
                hint = f" ({layer} is a layer position: shards[:, {layer}] takes positions)"
            raise NameNotFoundError(
                f"layer {short_repr(layer)} was not recorded; recorded layer values are {layers}{hint}"
            ) from None

    def _example(self, example: int) -> tuple[int, int]:
        example = wrap_index(int(example), self.n_examples, "example", CACHE_RANGE)
        return layout.shard_of(example, self.examples_per_shard)

    def get(self, example: int, layer: int, token: int, *, dtype: str | None = None) -> npt.NDArray[Any]:
        """The ``(D,)`` activation of ``example`` at layer *value* ``layer`` and token ``token``
        (as `read_dtype`, or ``dtype``)."""
        k, i = self._example(example)
        t = int(token)
        if not -self.shape[2] <= t < self.shape[2]:
            raise IndexError(f"token {token} out of range [0, {self.shape[2]})")
        li = self.layer_index(layer)
        raw = np.asarray(self.shard(k)[i, li, t])
        number = (k * self.examples_per_shard + i) * self.shape[1] + li
        return self._values(
            raw,
            lambda: np.broadcast_to(self.scale_shard(k)[i, li, t], raw.shape),
            dtype,
            lambda: number * self.shape[2] + t % self.shape[2],
        )

    def example(self, example: int, layer: int, *, dtype: str | None = None) -> npt.NDArray[Any]:
        """The ``(T, D)`` slice of ``example`` at layer *value* ``layer`` (a view of the memmap
        when it needs no conversion, as `read_dtype`, or ``dtype``); reads nothing else."""
        k, i = self._example(example)
        li = self.layer_index(layer)
        raw = np.asarray(self.shard(k)[i, li])
        first = ((k * self.examples_per_shard + i) * self.shape[1] + li) * self.shape[2]
        return self._values(
            raw,
            lambda: np.broadcast_to(self.scale_shard(k)[i, li][:, None], raw.shape),
            dtype,
            lambda: first + np.arange(self.shape[2])[:, None],
        )

    def locate(self, example: int, layer: int, token: int) -> tuple[int, int]:
        """``(shard_index, byte_offset)`` of a vector; pure arithmetic, no I/O."""
        return self._locate(example, layer, token, self.metadata.d_model * self.metadata.itemsize)

    def locate_scale(self, example: int, layer: int, token: int) -> tuple[int, int]:
        """``(shard_index, byte_offset)`` of a vector's scale in its shard's scale file
        (float8_e4m3): ``offset_in_vectors * 4``; pure arithmetic, no I/O."""
        return self._locate(example, layer, token, SCALES_DTYPE.itemsize)

    def _locate(self, example: int, layer: int, token: int, vector_nbytes: int) -> tuple[int, int]:
        md = self.metadata
        return layout.locate(
            int(example), self.layer_index(layer), int(token), n_examples=md.n_examples,
            examples_per_shard=md.examples_per_shard, n_layers=md.n_layers, tokens=md.tokens_per_ex,
            vector_nbytes=vector_nbytes,
        )  # fmt: skip

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        """``logical[key]``: the layer axis takes positions ``0..L-1`` (class docstring), values
        as `read_dtype`."""
        try:
            raw = getitem(self, key)
            if self.read_dtype == self.dtype:
                return raw
            return self._values(
                raw, lambda: getitem(_BroadcastScales(self), key), vectors=lambda: getitem(_VectorNumbers(self), key)
            )
        except IndexError as err:
            value = layer_value_given_as_position(key, self.shape[1], self._layer_idx)
            if value is None:
                raise
            layers = list(self.metadata.layers)
            raise LayerIndexError(
                f"layer position {value} is out of range for {len(layers)} layers (positions 0..{len(layers) - 1}); "
                f"{value} is a recorded layer value (layers {layers}): select it by value with "
                f"shards[..., shards.layer_index({value}), ...] (position {self._layer_idx[value]}), "
                f"or shards.example(i, {value})"
            ) from err

    def to_float32(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Values read from this cache (as `read_dtype`) as float32 (widens bfloat16 bits exactly)."""
        return to_float32(values, self.read_dtype)

    # -- views for other tools (`views`; dask and xarray are optional) -------------
    def to_dask(self, examples_per_chunk: int | None = None, *, dtype: str | None = None) -> Any:
        """A ``dask.array`` of the logical ``(N, L, T, D)`` tensor over the shard memmaps (no copy
        where no conversion is needed); one chunk per shard, or ``examples_per_chunk`` examples
        (never across shards). Values as `read_dtype`, or ``dtype`` (bfloat16 as float32)."""
        from .views import to_dask

        return to_dask(self if dtype is None else self.with_dtype(dtype), examples_per_chunk)

    def to_xarray(self, examples_per_chunk: int | None = None, *, dtype: str | None = None) -> Any:
        """An ``xarray.DataArray`` (dims example, layer, token, dim) over `to_dask`, layer values and
        columns as coordinates."""
        from .views import to_xarray

        return to_xarray(self if dtype is None else self.with_dtype(dtype), examples_per_chunk)

    def report(self, out: str | Path | None = None, *, progress: bool | None = None) -> Any:
        """One picture of this cache (`report`: norms by layer, dimensions with outliers
        marked, CLS and content tokens, lengths and truncation, shard sizes), from one streaming
        pass; saved to ``out`` (``.png`` or ``.html``) when given. Needs the ``plot`` extra."""
        from .report import report

        return report(self, out, progress=progress)

    # -- integrity -----------------------------------------------------------------------
    @property
    def block_size(self) -> int | None:
        """Bytes each digest of blocks.json covers (protocol 3.1), or None for a cache without
        blocks.json. Read and checked on first use (`block_digests`)."""
        blocks = self._blocks()
        return None if blocks is None else blocks.block_size

    def block_digests(self, name: str) -> list[str] | None:
        """The xxh3_128 digest of each block of listed file ``name`` (block ``i`` covers bytes
        ``[i * block_size, (i + 1) * block_size)``), or None for a cache without blocks.json.

        blocks.json is read on first use and checked against shards.json's size and digest
        of it and against its schema (one list per listed file, as many digests as it has
        blocks): `ManifestError` otherwise. `NameNotFoundError` for a file the cache does
        not list.
        """
        blocks = self._blocks()
        if blocks is None:
            return None
        digests = blocks.files.get(name) if isinstance(name, str) else None
        if digests is None:
            raise NameNotFoundError(f"{self.path}: no listed file {short_repr(name)} has block digests")
        return list(digests)

    def verify(self, *, progress: bool | None = False, on_bytes: Callable[[int], None] | None = None) -> int:
        """Recompute every file's size and xxh3_128 digest, and the metadata hash; check
        stats.json and blocks.json against their schemas. Where blocks.json holds a damaged
        file's block digests (protocol 3.1), the message names the blocks that differ.

        A remote cache is read from the server (not from the block cache), several files at
        once, and its metadata.json fetched again. Returns the number of bytes checked.
        Raises `ChecksumMismatchError` (or `InvalidCacheError` for several kinds) listing every
        problem.
        """
        from .verify import verify

        return verify(self, progress=progress, on_bytes=on_bytes)

    def _blocks(self) -> BlockDigests | None:
        if self.manifest.blocks is None:
            return None
        self._check_pid()
        blocks: BlockDigests | None = self._aux.get("blocks")
        if blocks is None:
            blocks = self._aux["blocks"] = load_blocks(self.path, self.manifest)
        return blocks


def layer_value_given_as_position(key: Any, n_layers: int, layer_idx: Mapping[int, int]) -> int | None:
    """The first recorded layer value (a key of ``layer_idx``) that ``key``'s layer component
    (``key[1]``) holds out of the position range ``[-n_layers, n_layers)``, or None (only looked
    at once an index has failed)."""
    if not isinstance(key, tuple) or len(key) < 2 or key[0] is Ellipsis or key[1] is Ellipsis:
        return None
    try:
        values = np.asarray(key[1]).reshape(-1)
    except (TypeError, ValueError):
        return None
    if values.dtype.kind not in "iu":
        return None
    for v in values.tolist():
        if not -n_layers <= v < n_layers and v in layer_idx:
            return int(v)
    return None


def default_read_dtype(stored: str) -> str:
    """The dtype a cache of ``stored`` values is read as by default: float16 for float8_e4m3
    (its values need a float dtype, and float16 is as compact as one gets), else the stored one."""
    return "float16" if stored == FLOAT8 else stored


class StoredValues:
    """`Shards.raw`: the stored values, indexed like the logical tensor (numpy semantics)."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.shape = shards.shape
        self.dtype = shards.numpy_dtype

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        return getitem(self.shards, key)

    def __repr__(self) -> str:
        return f"<stored {self.shards.dtype} values of {self.shards.path.name[:12]}, shape {self.shape}>"


class Scales:
    """`Shards.scales`: a float8_e4m3 cache's scales, indexed like the logical ``(N, L, T)``
    tensor of its vectors (numpy semantics); shard ``k``'s are `Shards.scale_shard` ``(k)``."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.shape = shards.shape[:3]
        self.dtype = SCALES_DTYPE

    def __getitem__(self, key: Any) -> npt.NDArray[np.float32]:
        # The scale of value [i, l, t, d] is that of vector [i, l, t]: index the broadcast view
        # with the key and the slice [0:1] of the last axis (a slice, not an integer, so numpy
        # places the key's advanced indices as it would in 3 dimensions), then drop that axis.
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            key = (*key, slice(0, 1))
        elif len(key) <= 3:
            key = (*key, *(slice(None),) * (3 - len(key)), slice(0, 1))
        else:
            raise IndexError(f"too many indices: the scales are 3-dimensional (N, L, T), but {len(key)} were indexed")
        return getitem(_BroadcastScales(self.shards), key)[..., 0]

    def __repr__(self) -> str:
        return f"<float32 scales of {self.shards.path.name[:12]}, shape {self.shape}>"


class _BroadcastScales:
    """The scales as a `ShardedArray` of the values' shape: shard ``k`` is its scale memmap
    broadcast over D (no copy), so indexing it with a key gives each value's scale."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.shape = shards.shape
        self.n_examples = shards.n_examples
        self.examples_per_shard = shards.examples_per_shard
        self.numpy_dtype = SCALES_DTYPE

    def shard(self, k: int) -> npt.NDArray[Any]:
        scales = self.shards.scale_shard(k)
        return np.broadcast_to(scales[..., None], (*scales.shape, self.shape[3]))


class _VectorNumbers:
    """The number of each value's vector, ``(example * L + layer_idx) * T + token``, as a
    `ShardedArray` of the values' shape (shard ``k`` made when indexed, broadcast over D): the
    same key as a read gives the vector of each value read (`Shards.check_scales`)."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.shape = shards.shape
        self.n_examples = shards.n_examples
        self.examples_per_shard = shards.examples_per_shard
        self.numpy_dtype = np.dtype(np.int64)

    def shard(self, k: int) -> npt.NDArray[Any]:
        n, (n_layers, tokens, d_model) = self.shards.manifest.shards.counts[k], self.shape[1:]
        first = k * self.examples_per_shard * n_layers * tokens
        numbers = np.arange(first, first + n * n_layers * tokens, dtype=np.int64).reshape(n, n_layers, tokens)
        return np.broadcast_to(numbers[..., None], (n, n_layers, tokens, d_model))
