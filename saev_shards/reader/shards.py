"""`Shards`: an open cache, the logical ``(N, L, T, D)`` tensor and everything beside it."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import float8, layout
from .._indexing import CACHE_RANGE, getitem, wrap_index
from ..dtypes import convert, to_float32
from ..errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    InvalidCacheError,
    LayerIndexError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    NameNotFoundError,
    NotRegularFileError,
    Problem,
    ScaleError,
    raise_problems,
)
from ..fileio import IO_CHUNK, open_regular
from ..manifest import Blocks, Manifest
from ..metadata import Metadata, parse_metadata
from ..progress import Progress
from ..protocol.common import CHECKSUMS_FILE, FLOAT8, MAX_METADATA_BYTES, METADATA_FILE, SCALES_DTYPE, STATS_FILE
from ..protocol.jsonfile import is_int, short_repr
from ..protocol.v31 import load_blocks
from ..storage.base import Files
from ..storage.local import LocalFiles
from ..units import html_table, human_bytes
from .reads import ReadPaths, check_read_dtype
from .sidecars import Sidecars


class Shards(ReadPaths, Sidecars):
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
    paths `reads.ReadPaths`, labels, columns, text and statistics `sidecars.Sidecars`;
    this module keeps the notebook API, the views and `verify`.
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
            if vectors is not None and not float8.scales_plain(found):
                self.check_scales(found, vectors)
            return convert(raw, self.dtype, want, found, elementwise=True)
        return convert(raw, self.dtype, want)

    def __repr__(self) -> str:
        md = self.metadata
        n, l_, t, d = md.shape
        cls = "CLS + " if md.cls_token else ""
        extras = []
        if self.manifest.labels is not None:
            extras.append("labels")
        extras += [f"column {c}" for c in self.manifest.columns]
        extras += [f"text {t_}" for t_ in self.manifest.text]
        if self.manifest.stats is not None:
            extras.append("stats")
        read = f" (read as {self.read_dtype})" if self.read_dtype != md.dtype else ""
        return (
            f"<saev_shards.Shards {md.hash[:12]} {md.family}:{md.ckpt} shape=({n}, {l_}, {t}, {d}) "
            f"{md.dtype}{read} layers={list(md.layers)}"
            + (f" ({len(md.sites)} sites)" if md.sites is not None else "")
            + f" tokens={cls}{md.patches_per_ex} "
            f"shards={self.n_shards}x{md.examples_per_shard} {human_bytes(md.nbytes + md.scales_nbytes)} "
            f"protocol={md.protocol}" + (f" [{', '.join(extras)}]" if extras else "") + f" at {self.location}>"
        )

    def summary_rows(self) -> list[tuple[str, str]]:
        """What a notebook shows of this cache (`_repr_html_`): one ``(name, value)`` per line."""
        md = self.metadata
        n, l_, t, d = md.shape
        columns = ", ".join(
            f"{name} {entry.dtype} {tuple(entry.shape)}" for name, entry in self.manifest.columns.items()
        )
        rows = [
            ("cache", md.hash),
            ("model", f"{md.family} {md.ckpt}"),
            ("dataset", md.dataset or "-"),
            ("shape", f"({n:,}, {l_}, {t}, {d})  examples x layers x tokens x d_model"),
            ("dtype", md.dtype + (f" (read as {self.read_dtype})" if self.read_dtype != md.dtype else "")),
        ]
        if md.sites is None:
            rows.append(("layers", ", ".join(map(str, md.layers)) + "  (block outputs)"))
        else:
            rows += [(f"layer {layer}", str(site)) for layer, site in zip(md.layers, md.sites, strict=True)]
        rows += [
            ("tokens", f"{t} per example" + (f" (CLS + {md.patches_per_ex})" if md.cls_token else "")),
            ("shards", f"{self.n_shards:,} x {md.examples_per_shard:,} examples"),
            ("bytes", human_bytes(md.nbytes + md.scales_nbytes)),
            ("labels", "labels.bin" if self.manifest.labels is not None else "-"),
            ("columns", columns or "-"),
            ("text", ", ".join(self.manifest.text) or "-"),
            ("stats", "stats.json" if self.manifest.stats is not None else "-"),
            ("protocol", md.protocol),
            ("location", self.location),
        ]
        return rows

    def _repr_html_(self) -> str:
        """A short table of the cache, for a notebook (``shards.report()`` draws its picture)."""
        md = self.metadata
        return html_table(
            f"saev_shards.Shards {md.hash[:12]}",
            self.summary_rows(),
            "shards.report() draws its picture (one pass over the cache); shards[i] reads example i",
        )

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
                self.files.prefetch(self._fd(k), local * example_nbytes, (local + count) * example_nbytes)
            if scales:
                first, last = local * scale_nbytes, (local + count) * scale_nbytes
                self.files.prefetch(self._scale_fd(k), first, last, scattered=True)
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
        md = self.metadata
        return layout.locate(
            int(example),
            self.layer_index(layer),
            int(token),
            n_examples=md.n_examples,
            eps=md.examples_per_shard,
            n_layers=md.n_layers,
            tokens=md.tokens_per_ex,
            d_model=md.d_model,
            itemsize=md.itemsize,
        )

    def locate_scale(self, example: int, layer: int, token: int) -> tuple[int, int]:
        """``(shard_index, byte_offset)`` of a vector's scale in its shard's scale file
        (float8_e4m3): ``offset_in_vectors * 4``; pure arithmetic, no I/O."""
        md = self.metadata
        return layout.locate(
            int(example),
            self.layer_index(layer),
            int(token),
            n_examples=md.n_examples,
            eps=md.examples_per_shard,
            n_layers=md.n_layers,
            tokens=md.tokens_per_ex,
            d_model=1,
            itemsize=SCALES_DTYPE.itemsize,
        )

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
            value = self._layer_value_given_as_position(key)
            if value is None:
                raise
            layers = list(self.metadata.layers)
            raise LayerIndexError(
                f"layer position {value} is out of range for {len(layers)} layers (positions 0..{len(layers) - 1}); "
                f"{value} is a recorded layer value (layers {layers}): select it by value with "
                f"shards[..., shards.layer_index({value}), ...] (position {self._layer_idx[value]}), "
                f"or shards.example(i, {value})"
            ) from err

    def _layer_value_given_as_position(self, key: Any) -> int | None:
        """The first recorded layer value that ``key``'s layer component (``key[1]``) holds out of
        the position range, or None (only looked at once an index has failed)."""
        if not isinstance(key, tuple) or len(key) < 2 or key[0] is Ellipsis or key[1] is Ellipsis:
            return None
        n_layers = self.shape[1]
        try:
            values = np.asarray(key[1]).reshape(-1)
        except (TypeError, ValueError):
            return None
        if values.dtype.kind not in "iu":
            return None
        for v in values.tolist():
            if not -n_layers <= v < n_layers and v in self._layer_idx:
                return int(v)
        return None

    def to_float32(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Values read from this cache (as `read_dtype`) as float32 (widens bfloat16 bits exactly)."""
        return to_float32(values, self.read_dtype)

    # -- views for other tools (saev_shards.views; dask and xarray are optional) -------------
    def to_dask(self, examples_per_chunk: int | None = None, *, dtype: str | None = None) -> Any:
        """A ``dask.array`` of the logical ``(N, L, T, D)`` tensor over the shard memmaps (no copy
        where no conversion is needed); one chunk per shard, or ``examples_per_chunk`` examples
        (never across shards). Values as `read_dtype`, or ``dtype`` (bfloat16 as float32)."""
        from ..views import to_dask

        return to_dask(self if dtype is None else self.with_dtype(dtype), examples_per_chunk)

    def to_xarray(self, examples_per_chunk: int | None = None, *, dtype: str | None = None) -> Any:
        """An ``xarray.DataArray`` (dims example, layer, token, dim) over `to_dask`, layer values and
        columns as coordinates."""
        from ..views import to_xarray

        return to_xarray(self if dtype is None else self.with_dtype(dtype), examples_per_chunk)

    def report(self, out: str | Path | None = None, *, progress: bool | None = None) -> Any:
        """One picture of this cache (`saev_shards.report`: norms by layer, dimensions with outliers
        marked, CLS and content tokens, lengths and truncation, shard sizes), from one streaming
        pass; saved to ``out`` (``.png`` or ``.html``) when given. Needs the ``plot`` extra."""
        from ..report import report

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

    def _blocks(self) -> Blocks | None:
        if self.manifest.blocks is None:
            return None
        self._check_pid()
        blocks: Blocks | None = self._aux.get("blocks")
        if blocks is None:
            blocks = self._aux["blocks"] = load_blocks(self.path, self.manifest)
        return blocks

    def verify(self, *, progress: bool | None = False, on_bytes: Callable[[int], None] | None = None) -> int:
        """Recompute every file's size and xxh3_128 digest, and the metadata hash; check
        stats.json and blocks.json against their schemas. Where blocks.json holds a damaged
        file's block digests (protocol 3.1), the message names the blocks that differ.

        A remote cache is read from the server (not from the block cache), several files at
        once, and its metadata.json fetched again. Returns the number of bytes checked.
        Raises `ChecksumMismatchError` (or `InvalidCacheError` for several kinds) listing every
        problem.
        """
        problems = self._metadata_problems()
        files = self.manifest.files()
        total = sum(n for _, n, _ in files)
        unchecked = [name for name, _, digest in files if digest is None]
        checked = 0
        blocks = self._verify_blocks()
        scale_files = {name: k for k, name in enumerate(self.manifest.scales.names)} if self.manifest.scales else {}
        with Progress(total, f"verify {self.path.name[:12]}", enabled=progress) as bar:

            def tick(n: int) -> None:
                bar.update(n)
                if on_bytes is not None:
                    on_bytes(n)

            for (name, nbytes, digest), found in zip(files, self._hash_files(files, blocks, tick), strict=True):
                where = self.files.where(name)
                if isinstance(found, Problem):
                    problems.append(found)
                    continue
                size, got, block_digests = found
                checked += size
                if size != nbytes:
                    problems.append(Problem(FileSizeError, f"{where}: expected {nbytes} bytes, found {size}"))
                    continue
                if digest is not None and got != digest:
                    listed = blocks.files.get(name) if blocks is not None else None
                    damaged = _damaged_blocks(blocks, listed, block_digests, nbytes)
                    problems.append(
                        Problem(ChecksumMismatchError, f"{where}: xxh3_128 expected {digest}, found {got}{damaged}")
                    )
                    continue
                if name == STATS_FILE:  # its bytes are intact: check what they say
                    problems.extend(self._stats_problems())
                if name in scale_files:  # a scale file: every scale one the rule gives?
                    problems.extend(self._scale_file_problems(scale_files[name]))
                if self.manifest.blocks is not None and name == self.manifest.blocks.name:
                    problems.extend(self._blocks_problems())
        reported = {p.message.split(": ")[0] for p in problems}  # a file reported once: its digest or size
        problems.extend(p for p in self._padding_problems() if p.message.split(": ")[0] not in reported)
        raise_problems(problems, self.location)
        if unchecked and self.metadata.format.history:
            warnings.warn(
                f"{self.location}: {self.metadata.format.summary} records no checksums: the sizes of its "
                f"{len(unchecked)} files, its name and the zero padding were checked, not the values",
                stacklevel=2,
            )
        elif unchecked:
            warnings.warn(
                f"{self.location}: {len(unchecked)} files have no recorded checksum (protocol 2.1 without "
                f"{CHECKSUMS_FILE}); only their sizes (and the zero padding) were checked",
                stacklevel=2,
            )
        return checked

    def _scale_file_problems(self, k: int) -> list[Problem]:
        """Scale file ``k`` read again (intact: its digest matched), a bounded step at a time: the
        vectors whose scale the rule cannot give (`scale_problems`), as one problem naming the
        first few and counting the rest."""
        md = self.metadata
        per_example = md.n_layers * md.tokens_per_ex
        n, first = self.manifest.shards.counts[k], k * self.examples_per_shard
        step = max(1, _SCALES_STEP // max(1, per_example))
        buffer = np.empty((min(step, n), md.n_layers, md.tokens_per_ex), SCALES_DTYPE)
        found: list[str] = []
        count = 0
        for a in range(first, first + n, step):
            b = min(first + n, a + step)
            out = buffer[: b - a]
            self._read_examples_into(a, b, out, per_example * SCALES_DTYPE.itemsize, self._scale_fd)
            numbers = np.arange(a * per_example, b * per_example).reshape(out.shape)
            bad = self.scale_problems(out, functools.partial(np.asarray, numbers))
            count += len(bad)
            found += [message for _, message in bad[: _LISTED_SCALES - len(found)]]
        if not count:
            return []
        more = f"; and {count - len(found)} more vectors of this file" if count > len(found) else ""
        return [Problem(ScaleError, "; ".join(found) + more)]

    def _metadata_problems(self) -> list[Problem]:
        """metadata.json read again (from the server for a remote cache): the same configuration and hash?"""
        where = self.files.where(METADATA_FILE)
        obj, problems = self.files.read_json(METADATA_FILE, MAX_METADATA_BYTES, MetadataFileError)
        if problems:
            return problems
        try:
            current = parse_metadata(obj, self.path.name)
        except MetadataError as err:
            return [Problem(MetadataFileError, f"{where}: {err}")]
        if current != self.metadata:
            return [Problem(HashMismatchError, f"{where}: changed since the cache was opened")]
        if self.path.name != current.hash:
            return [Problem(HashMismatchError, f"{self.location}: directory name is not the hash {current.hash}")]
        return []

    def _padding_problems(self) -> list[Problem]:
        """saev's caches (protocol 2.1 and its earlier formats, protocol.md 9): the bytes past the
        last example of a last shard padded to a full shard, and every byte of the empty file
        after a shard filled exactly, are zeros, as its writer's memmaps left them. The one check
        of content a cache without checksums allows."""
        md, manifest = self.metadata, self.manifest
        if not md.format.padded_last:  # protocol 2.1 and earlier: local only (`open_remote` refuses them)
            return []
        regions: list[tuple[str, int, int, str]] = []
        if len(manifest.shards):
            last = manifest.shards[-1]
            data = last.n_examples * md.example_nbytes
            if last.nbytes > data:
                regions.append((last.name, data, last.nbytes, "the padding past the last example"))
        regions += [(e.name, 0, e.nbytes, "the all-zero file saev's writer left after the last shard") for e in
                    manifest.empty_shards]  # fmt: skip
        problems: list[Problem] = []
        for name, start, end, what in regions:
            path = self.path / name
            try:
                first = _first_nonzero(path, start, end)
            except (OSError, NotRegularFileError):
                continue  # reported by the size and digest checks
            if first is not None:
                problems.append(
                    Problem(
                        ChecksumMismatchError,
                        f"{path}: byte {first:,} is not zero; bytes {start:,}-{end - 1:,} are {what}, which saev's "
                        "writer leaves zero (the file changed after it was written)",
                    )
                )
        return problems

    def _hash_files(
        self, files: list[tuple[str, int, str | None]], blocks: Blocks | None, tick: Callable[[int], None]
    ) -> Iterator[tuple[int, str, list[str]] | Problem]:
        """``(size, xxh3_128, digests of its blocks)`` of each file in order (block digests where
        ``blocks`` lists the file), or the problem reading it."""

        def block_size(name: str) -> int | None:
            return blocks.block_size if blocks is not None and name in blocks.files else None

        def one(name: str) -> tuple[int, str, list[str]] | Problem:
            try:
                return self.files.verify_file(name, block_size(name), tick)
            except NotRegularFileError as err:
                return Problem(ManifestError, str(err))
            except CacheNotFoundError as err:
                return Problem(CacheNotFoundError, str(err))

        names = [name for name, _, _ in files]
        workers = max(1, min(len(names), self.files.streams // 2))  # each a stream: from a server, several
        if workers == 1:
            yield from map(one, names)
            return
        with ThreadPoolExecutor(workers) as pool:
            yield from pool.map(one, names)

    def _verify_blocks(self) -> Blocks | None:
        """blocks.json for `verify` to name damaged blocks with, fresh from disk; None if there
        is none or it does not check out (`verify` reports why with the rest)."""
        if self.manifest.blocks is None:
            return None
        self._aux.pop("blocks", None)
        try:
            return self._blocks()
        except (InvalidCacheError, OSError):
            return None

    def _blocks_problems(self) -> list[Problem]:
        try:
            self._blocks()
        except InvalidCacheError as err:
            return err.problems
        return []


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


def _first_nonzero(path: Path, start: int, end: int) -> int | None:
    """Offset of the first byte of ``path`` in ``[start, end)`` that is not zero (None: all
    zero, or the file ends first), read one chunk at a time."""
    with open_regular(path) as f:
        offset = start
        while offset < end:
            chunk = os.pread(f.fileno(), min(IO_CHUNK, end - offset), offset)
            if not chunk:
                return None
            values = np.frombuffer(chunk, dtype=np.uint8)
            if values.any():
                return offset + int(np.argmax(values != 0))
            offset += len(chunk)
    return None


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


#: Scales `verify` reads at a time (4 bytes each), and bad ones it names per scale file.
_SCALES_STEP = 1 << 20
_LISTED_SCALES = 3
#: Damaged blocks named in one problem of `verify` (the rest are counted).
_LISTED_BLOCKS = 5


def _damaged_blocks(blocks: Blocks | None, listed: Sequence[str] | None, found: list[str], nbytes: int) -> str:
    """``"; block 7 (bytes 117440512-134217727) differs"`` for the blocks of a file whose
    digests ``found`` (read now) differ from those ``listed`` in blocks.json; "" without them."""
    if blocks is None or listed is None or len(found) != len(listed):
        return ""
    bad = [i for i, (a, b) in enumerate(zip(listed, found, strict=True)) if a != b]
    if not bad:
        return ""
    spans = [f"{i} (bytes {'-'.join(map(str, blocks.span(i, nbytes)))})" for i in bad[:_LISTED_BLOCKS]]
    more = f" and {len(bad) - _LISTED_BLOCKS} more" if len(bad) > _LISTED_BLOCKS else ""
    return f"; block{'s' if len(bad) > 1 else ''} {', '.join(spans)}{more} differ{'' if len(bad) > 1 else 's'}"
