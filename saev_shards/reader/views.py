"""Hand a cache to dask, xarray and zarr without copying it.

* `to_dask`: a ``dask.array`` of the logical ``(N, L, T, D)`` tensor, one chunk per shard
  (or finer, never across shards), each chunk a view of its shard's memory map. The graph
  holds the `Shards` object, which pickles without data or handles, so the chunks work in
  threads, processes and distributed workers alike.
* `to_xarray`: that array as an ``xarray.DataArray`` with dims ``example, layer, token,
  dim``, the layer values as the ``layer`` coordinate, and the cache's columns as
  coordinates along ``example`` (``(N,)`` columns) or ``example, token`` (``(N, T)``
  columns such as ``token_ids``).
* `zarr_references`: a read-only description (kerchunk's reference format, version 1) of
  the shards as one zarr v2 array with no compressor, whose chunks are byte ranges of the
  shard files; zarr opens it through fsspec's ``reference://`` filesystem.

Values come as the cache's `Shards.read_dtype` (float8_e4m3 caches dequantized, to float16
by default: `Shards.with_dtype` or ``dtype=`` for another). bfloat16 has no numpy or zarr
dtype: dask and xarray get float32 values widened chunk by chunk. `zarr_references` refuses
bfloat16 and float8_e4m3 caches (zarr cannot apply a scale per vector).

dask, xarray and fsspec come with ``pip install 'saev-shards[views]'``; each is imported
only when its function is called.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import orjson

from ..codecs import dtypes
from ..codecs.bfloat16 import bf16_to_float32
from ..errors import ShardsError
from ..optional import require
from ..protocol.common import FLOAT8

if TYPE_CHECKING:
    from .shards import Shards

#: The dims of the logical tensor, in order.
DIMS = ("example", "layer", "token", "dim")


class _Window:
    """The logical tensor as an array-like dask can slice: ``shards[a:b]`` views within one shard."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self.shape = shards.shape
        self.dtype = shards.numpy_dtype if shards.read_dtype == shards.dtype else dtypes.READ_DTYPES[shards.read_dtype]
        self.ndim = 4

    def __getitem__(self, key: Any) -> npt.NDArray[Any]:
        return np.asarray(self.shards[key])


def _chunks(shards: Shards, examples_per_chunk: int | None) -> tuple[int, ...]:
    sizes = [s.n_examples for s in shards.manifest.shards]
    if examples_per_chunk is None:
        return tuple(sizes)
    if examples_per_chunk < 1:
        raise ShardsError(f"examples_per_chunk: expected a positive number, found {examples_per_chunk}")
    out: list[int] = []
    for size in sizes:
        out += [examples_per_chunk] * (size // examples_per_chunk)
        if size % examples_per_chunk:
            out.append(size % examples_per_chunk)
    return tuple(out)


def to_dask(shards: Shards, examples_per_chunk: int | None = None) -> Any:
    """A dask array of the cache's logical ``(N, L, T, D)`` tensor; see `Shards.to_dask`."""
    da = require("dask.array", "views", "Shards.to_dask")
    _, n_layers, tokens, d_model = shards.shape
    chunks = (_chunks(shards, examples_per_chunk) or (0,), (n_layers,), (tokens,), (d_model,))
    # The name is the dask key: it names the cache and its chunking, so two views never share keys.
    name = f"saev-{shards.metadata.hash}-{examples_per_chunk or 'shard'}"
    arr = da.from_array(_Window(shards), chunks=chunks, asarray=False, lock=False, fancy=False, name=name)
    if shards.read_dtype == "bfloat16":
        return arr.map_blocks(bf16_to_float32, dtype=np.float32)
    return arr


def to_xarray(shards: Shards, examples_per_chunk: int | None = None) -> Any:
    """An xarray DataArray over `to_dask`; see `Shards.to_xarray`."""
    xr = require("xarray", "views", "Shards.to_xarray")
    md = shards.metadata
    coords: dict[str, Any] = {"layer": ("layer", np.asarray(md.layers, np.int64))}
    if md.sites is not None:  # protocol 3.2: what each layer slot holds, "module:input" or "module:output"
        coords["site"] = ("layer", np.array([str(site) for site in md.sites], dtype=object))
    for name, values in shards.columns.items():
        if name in DIMS:
            continue
        if values.ndim == 1:
            coords[name] = ("example", values)
        elif values.shape[1:] == (md.tokens_per_ex,):
            coords[name] = (("example", "token"), values)
    attrs = {
        "hash": md.hash,
        "family": md.family,
        "ckpt": md.ckpt,
        "dataset": md.dataset,
        "stored_dtype": md.dtype,
        "read_dtype": shards.read_dtype,
        "cls_token": int(md.cls_token),
        "path": str(shards.path),
    }
    return xr.DataArray(to_dask(shards, examples_per_chunk), dims=DIMS, coords=coords, attrs=attrs, name="acts")


def zarr_references(shards: Shards, *, absolute: bool = True) -> dict[str, Any]:
    """A kerchunk-style reference description of the cache as a zarr v2 group holding ``acts``.

    Zarr v2 chunks all have one shape and every chunk file must hold a full chunk, but the
    last 3.0 shard is usually shorter than the others; so a chunk is ``g`` examples, where
    ``g`` is the largest number dividing every shard's example count (one chunk per shard
    when the shards are all full). Each reference is ``[shard file, offset, length]``.
    Columns are added as 1-D or 2-D arrays beside ``acts``. Paths are absolute unless
    ``absolute=False`` (then relative to the cache folder: open with
    ``storage_options={"fo": refs, "remote_protocol": "file"}`` from inside it).

    >>> refs = zarr_references(shards)                                 # doctest: +SKIP
    >>> g = zarr.open_group("reference://", mode="r", storage_options={"fo": refs})  # doctest: +SKIP
    >>> g["acts"][5, 0]                                                # doctest: +SKIP
    """
    md = shards.metadata
    if md.dtype == "bfloat16":
        raise ShardsError(
            f"{shards.path}: bfloat16 has no zarr dtype; write the cache as float16 or float32 "
            "to reference it from zarr"
        )
    if md.dtype == FLOAT8:
        raise ShardsError(
            f"{shards.path}: float8_e4m3 values need their per-vector scales, which zarr cannot apply; "
            "convert the cache to float16 or float32 (saev-shards convert --dtype float16) to reference it "
            "from zarr, or read it with Shards.to_dask"
        )
    base = Path(shards.path)

    def where(name: str) -> str:
        return str(base / name) if absolute else name

    _, n_layers, tokens, d_model = md.shape
    sizes = [s.n_examples for s in shards.manifest.shards if s.n_examples]
    group = math.gcd(*sizes) if sizes else 1
    example_nbytes = md.example_nbytes
    refs: dict[str, Any] = {
        ".zgroup": _json({"zarr_format": 2}),
        ".zattrs": _json({"hash": md.hash, "layers": list(md.layers), "family": md.family, "ckpt": md.ckpt}),
        "acts/.zarray": _json(_zarray(md.shape, (group, n_layers, tokens, d_model), md.numpy_dtype)),
        "acts/.zattrs": _json({"_ARRAY_DIMENSIONS": list(DIMS)}),
    }
    chunk = 0
    for entry in shards.manifest.shards:
        for start in range(0, entry.n_examples, group):
            refs[f"acts/{chunk}.0.0.0"] = [where(entry.name), start * example_nbytes, group * example_nbytes]
            chunk += 1
    for name, col in shards.manifest.columns.items():
        shape = tuple(col.shape)
        dt = np.dtype(col.dtype)
        refs[f"{name}/.zarray"] = _json(_zarray(shape, shape, dt))
        dims = (
            ["example", "token"]
            if shape[1:] == (tokens,)
            else ["example", *(f"{name}_{i}" for i in range(1, len(shape)))]
        )
        refs[f"{name}/.zattrs"] = _json({"_ARRAY_DIMENSIONS": dims})
        if col.nbytes:
            refs[f"{name}/{'.'.join('0' for _ in shape)}"] = [where(col.name), 0, col.nbytes]
    return {"version": 1, "refs": refs}


def write_zarr_references(shards: Shards, path: str | os.PathLike[str], *, absolute: bool = True) -> Path:
    """Write `zarr_references` as JSON to ``path``; returns the path."""
    out = Path(path)
    out.write_bytes(orjson.dumps(zarr_references(shards, absolute=absolute)))
    return out


def _zarray(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype[Any]) -> Mapping[str, Any]:
    return {
        "zarr_format": 2,
        "shape": list(shape),
        "chunks": [max(1, c) for c in chunks],
        "dtype": dtype.str,
        "compressor": None,
        "filters": None,
        "fill_value": None,
        "order": "C",
        "dimension_separator": ".",
    }


def _json(obj: Any) -> str:
    return orjson.dumps(obj).decode()
