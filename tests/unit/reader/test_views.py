"""Shards.to_dask / to_xarray and zarr references: the same values as the cache, without copying it."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.errors import MissingDependencyError, ShardsError
from saev_shards.reader.views import write_zarr_references, zarr_references

from ...support.caches import small_metadata, write_cache

dask_array = pytest.importorskip("dask.array")
xr = pytest.importorskip("xarray")
warnings.filterwarnings("ignore", message="Consolidated metadata")


def _cache(root: Path, **changes: object) -> tuple[ss.Shards, np.ndarray]:
    md = small_metadata(**changes)
    lengths = (1 + np.arange(md.n_examples) % md.tokens_per_ex).astype(np.int32)
    data = write_cache(root, md, lengths=lengths, text=True)
    return ss.open(root / md.hash), data


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_dask_views_each_shard(root: Path, dtype: str) -> None:
    shards, logical = _cache(root, dtype=dtype)
    arr = shards.to_dask()
    assert arr.shape == shards.shape
    assert arr.chunks[0] == (5, 5, 5, 5, 3)  # one chunk per shard
    want = ss.to_float32(logical, dtype) if dtype == "bfloat16" else logical
    np.testing.assert_array_equal(arr.compute(), want)
    finer = shards.to_dask(examples_per_chunk=2)
    assert finer.chunks[0] == (2, 2, 1) * 4 + (2, 1)  # never across a shard boundary
    np.testing.assert_array_equal(finer[4:13, 1, 2:].compute(), want[4:13, 1, 2:])
    assert len(pickle.dumps(arr)) < 64 * 1024  # the graph carries the Shards, not the data
    both = dask_array.concatenate([arr, finer])  # distinct keys: each view keeps its own chunks
    np.testing.assert_array_equal(both.compute(), np.concatenate([want, want]))


def test_dask_chunks_are_views_of_the_memmaps(root: Path) -> None:
    shards, _ = _cache(root)
    seen: list[np.ndarray] = []

    def probe(block: np.ndarray) -> np.ndarray:
        seen.append(block)
        return block

    shards.to_dask().map_blocks(probe).compute(scheduler="sync")
    # Each task hands over a view of its shard's memory map, not a copy.
    for k in range(shards.n_shards):
        assert any(b.size and np.shares_memory(b, shards.shard(k)) for b in seen), k


def test_xarray_dims_layers_and_columns(root: Path) -> None:
    shards, logical = _cache(root)
    da = shards.to_xarray()
    assert da.dims == ("example", "layer", "token", "dim")
    assert da.coords["layer"].values.tolist() == [6, 11]
    np.testing.assert_array_equal(da.coords["lengths"].values, shards.columns["lengths"])
    np.testing.assert_array_equal(da.sel(layer=11).values, logical[:, 1])
    short = da.where(da.lengths > 3, drop=True)
    assert short.sizes["example"] == int((shards.columns["lengths"] > 3).sum())
    assert da.attrs["hash"] == shards.metadata.hash


def test_zarr_references_open_as_zarr(root: Path, tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    pytest.importorskip("fsspec")
    shards, logical = _cache(root)
    refs = zarr_references(shards)
    assert refs["version"] == 1
    group = zarr.open_group("reference://", mode="r", storage_options={"fo": refs})
    np.testing.assert_array_equal(group["acts"][:], logical)
    np.testing.assert_array_equal(group["acts"][22, 1, 3], logical[22, 1, 3])
    np.testing.assert_array_equal(group["lengths"][:], shards.columns["lengths"])
    assert group["acts"].chunks[0] == 1  # gcd(5, 3): every chunk is a whole one
    path = write_zarr_references(shards, tmp_path / "refs.json")
    group = zarr.open_group("reference://", mode="r", storage_options={"fo": str(path)})
    np.testing.assert_array_equal(group["acts"][5:10], logical[5:10])
    full, data = _cache(root, n_examples=20)  # four full shards: one chunk per shard
    group = zarr.open_group("reference://", mode="r", storage_options={"fo": zarr_references(full)})
    assert group["acts"].chunks[0] == 5
    np.testing.assert_array_equal(group["acts"][:], data)


def test_bfloat16_has_no_zarr_dtype(root: Path) -> None:
    shards, _ = _cache(root, dtype="bfloat16")
    with pytest.raises(ShardsError, match="bfloat16 has no zarr dtype"):
        zarr_references(shards)


def test_missing_extra_names_it(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    shards, _ = _cache(root)
    monkeypatch.setitem(sys.modules, "xarray", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"needs xarray.*pip install -e '.*\[views\]'"):
        shards.to_xarray()


def test_views_of_the_reference_dialect_with_a_padded_last_shard() -> None:
    zarr = pytest.importorskip("zarr")
    pytest.importorskip("fsspec")
    data = Path(__file__).resolve().parents[2] / "data" / "legacy-2.1-padded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        shards = ss.open(next(data.iterdir()))
    logical = np.asarray(shards[:])
    np.testing.assert_array_equal(shards.to_dask().compute(), logical)
    group = zarr.open_group("reference://", mode="r", storage_options={"fo": zarr_references(shards)})
    np.testing.assert_array_equal(group["acts"][:], logical)  # the padding past n_examples is never referenced


def test_xarray_names_the_sites_of_a_cache_of_sites() -> None:
    golden = Path(__file__).resolve().parents[2] / "data" / "golden-3.2"
    (cache,) = golden.iterdir()
    arr = ss.open(cache).to_xarray()
    assert list(arr.site.values) == ["blocks.1.mlp:input", "blocks.1.mlp:output"]
    assert list(arr.layer.values) == [9, 2]
    picked = arr.where(arr.site == "blocks.1.mlp:output", drop=True)
    assert picked.shape == (5, 1, 3, 4)
