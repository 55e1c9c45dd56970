"""`Shards`: an open cache, the logical ``(N, L, T, D)`` tensor and everything beside it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import layout
from .._indexing import CACHE_RANGE, getitem, wrap_index
from ..dtypes import to_float32
from ..errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    LayerIndexError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    NameNotFoundError,
    NotRegularFileError,
    Problem,
    raise_problems,
)
from ..fileio import IO_CHUNK, hash_file
from ..manifest import Manifest
from ..metadata import Metadata, parse_metadata
from ..progress import Progress
from ..protocol.common import CHECKSUMS_FILE, MAX_METADATA_BYTES, METADATA_FILE, STATS_FILE
from ..protocol.jsonfile import is_int, load_json, short_repr
from ..units import human_bytes
from .reads import ReadPaths
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

    Results are read-only views into the memmapped shards whenever numpy would return a
    view, copies otherwise. bfloat16 caches return raw uint16 bits; `to_float32` widens them.
    Per-example columns and text fields are mappings by name: ``shards.columns["lengths"]``,
    ``shards.text["prompt"]`` (`Fields`).

    Memmaps and file handles open lazily and per process: a pickled `Shards` carries no
    data and no handles, and a forked or unpickled copy opens its own.

    The class is a facade: handles and pickling are `handles.ShardHandles`, the ``pread``
    paths `reads.ReadPaths`, labels, columns, text and statistics `sidecars.Sidecars`;
    this module keeps the notebook API, the views and `verify`.
    """

    def __init__(self, path: Path, metadata: Metadata, manifest: Manifest) -> None:
        self.path = path
        self.metadata = metadata
        self.manifest = manifest
        md = metadata
        self.shape = md.shape
        self.dtype = md.dtype
        self.numpy_dtype = md.numpy_dtype
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
        return (
            f"<saev_shards.Shards {md.hash[:12]} {md.family}:{md.ckpt} shape=({n}, {l_}, {t}, {d}) "
            f"{md.dtype} layers={list(md.layers)} tokens={cls}{md.patches_per_ex} "
            f"shards={self.n_shards}x{md.examples_per_shard} {human_bytes(md.nbytes)} protocol={md.protocol}"
            + (f" [{', '.join(extras)}]" if extras else "")
            + f" at {self.path}>"
        )

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

    def get(self, example: int, layer: int, token: int) -> npt.NDArray[Any]:
        """The ``(D,)`` activation of ``example`` at layer *value* ``layer`` and token ``token``."""
        k, i = self._example(example)
        t = int(token)
        if not -self.shape[2] <= t < self.shape[2]:
            raise IndexError(f"token {token} out of range [0, {self.shape[2]})")
        return np.asarray(self.shard(k)[i, self.layer_index(layer), t])

    def example(self, example: int, layer: int) -> npt.NDArray[Any]:
        """The ``(T, D)`` view of ``example`` at layer *value* ``layer``; reads nothing else."""
        k, i = self._example(example)
        return np.asarray(self.shard(k)[i, self.layer_index(layer)])

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

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        """``logical[key]``: the layer axis takes positions ``0..L-1`` (class docstring)."""
        try:
            return getitem(self, key)
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
        """Values read from this cache as float32 (widens bfloat16 bits exactly)."""
        return to_float32(values, self.dtype)

    # -- views for other tools (saev_shards.views; dask and xarray are optional) -------------
    def to_dask(self, examples_per_chunk: int | None = None) -> Any:
        """A ``dask.array`` of the logical ``(N, L, T, D)`` tensor over the shard memmaps (no copy);
        one chunk per shard, or ``examples_per_chunk`` examples (never across shards)."""
        from ..views import to_dask

        return to_dask(self, examples_per_chunk)

    def to_xarray(self, examples_per_chunk: int | None = None) -> Any:
        """An ``xarray.DataArray`` (dims example, layer, token, dim) over `to_dask`, layer values and
        columns as coordinates."""
        from ..views import to_xarray

        return to_xarray(self, examples_per_chunk)

    # -- integrity -----------------------------------------------------------------------
    def verify(self, *, progress: bool | None = False, on_bytes: Callable[[int], None] | None = None) -> int:
        """Recompute every file's size and xxh3_128 digest, and the metadata hash; check
        stats.json against its schema.

        Returns the number of bytes checked. Raises `ChecksumMismatchError` (or
        `InvalidCacheError` for several kinds) listing every problem.
        """
        md_path = self.path / METADATA_FILE
        obj, problems = load_json(md_path, MAX_METADATA_BYTES, MetadataFileError)
        if not problems:
            try:
                current = parse_metadata(obj, self.path.name)
            except MetadataError as err:
                problems.append(Problem(MetadataFileError, f"{md_path}: {err}"))
            else:
                if current != self.metadata:
                    problems.append(Problem(HashMismatchError, f"{md_path}: changed since the cache was opened"))
                elif self.path.name != current.hash:
                    problems.append(
                        Problem(HashMismatchError, f"{self.path}: directory name is not the hash {current.hash}")
                    )
        files = self.manifest.files()
        total = sum(n for _, n, _ in files)
        unchecked = [name for name, _, digest in files if digest is None]
        checked = 0
        buffer = memoryview(bytearray(IO_CHUNK))
        with Progress(total, f"verify {self.path.name[:12]}", enabled=progress) as bar:
            for name, nbytes, digest in files:
                path = self.path / name

                def tick(n: int) -> None:
                    bar.update(n)
                    if on_bytes is not None:
                        on_bytes(n)

                try:
                    size, found = hash_file(path, tick, regular_only=True, buffer=buffer)
                except NotRegularFileError as err:
                    problems.append(Problem(ManifestError, str(err)))
                    continue
                except OSError as err:
                    problems.append(Problem(CacheNotFoundError, f"{path}: {err.strerror}"))
                    continue
                checked += size
                if size != nbytes:
                    problems.append(Problem(FileSizeError, f"{path}: expected {nbytes} bytes, found {size}"))
                    continue
                if digest is not None and found != digest:
                    problems.append(
                        Problem(ChecksumMismatchError, f"{path}: xxh3_128 expected {digest}, found {found}")
                    )
                    continue
                if name == STATS_FILE:  # its bytes are intact: check what they say
                    problems.extend(self._stats_problems())
        raise_problems(problems, str(self.path))
        if unchecked:
            warnings.warn(
                f"{self.path}: {len(unchecked)} files have no recorded checksum (protocol 2.1 without "
                f"{CHECKSUMS_FILE}); only their sizes were checked",
                stacklevel=2,
            )
        return checked
