"""convert.zarr_store: where a zarr activation log's stores are, in either layout, and the
arrays that hold its sequence parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from saev_shards.convert import zarr_store
from saev_shards.errors import ConvertError

from ...support.sources import zarr_source


def test_one_store_is_found_from_the_run_folder_or_itself(tmp_path: Path) -> None:
    zarr_source(tmp_path / "run")
    store = tmp_path / "run" / "activations.zarr"
    assert zarr_store.is_group(store) and not zarr_store.is_group(tmp_path / "run")
    assert zarr_store.find_stores(tmp_path / "run") == ("store", [store])
    assert zarr_store.find_stores(store) == ("store", [store])
    assert zarr_store.find_stores(tmp_path) == ("store", [])


def test_the_sharded_layout_lists_its_stores_in_order(tmp_path: Path) -> None:
    zarr_source(tmp_path / "run", n=9, shards=(4, 2, 3))
    layout, stores = zarr_store.find_stores(tmp_path / "run")
    assert layout == "sharded" and len(stores) == 3
    assert stores == sorted(stores) and all(zarr_store.is_group(s) for s in stores)


def test_the_schema_names_each_part_of_a_sequence(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    zarr_source(tmp_path / "run", p_max=6, r_max=4)
    store = tmp_path / "run" / "activations.zarr"
    arrays, _ = zarr_store.open_arrays(zarr, store)
    parts = zarr_store.schema(arrays, store)
    assert [(p.name, p.max_len) for p in parts] == [("prompt", 6), ("response", 4)]
    assert all(p.activations in set(arrays.array_keys()) for p in parts)


def test_a_folder_that_is_no_zarr_group_is_refused(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    (tmp_path / "x").mkdir()
    with pytest.raises(ConvertError, match="not a readable zarr group"):
        zarr_store.open_arrays(zarr, tmp_path / "x" / "missing.zarr")
