"""convert.run: the conversion itself: its options, and the same source giving the same cache."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from saev_shards.convert import ConvertOptions, convert, run

from ...support.sources import npy_source

pytest.importorskip("zarr")


warnings.filterwarnings("ignore", message="Consolidated metadata")


def test_convert_takes_the_fields_of_convert_options(tmp_path: Path) -> None:
    """`convert`'s keywords are `ConvertOptions`' fields (its signature says so); any other is
    refused as Python refuses an unexpected keyword argument."""
    names = list(inspect.signature(convert).parameters)
    assert names == ["src", *(f.name for f in dataclasses.fields(ConvertOptions))]
    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'dtypes'$"):
        convert(tmp_path / "x.npy", dtypes="float32")
    assert ConvertOptions(dtype="float32").keywords_of(run) == {
        f: getattr(ConvertOptions(), f)
        for f in ("allow_nonfinite", "stats", "restart", "progress", "durable", "check_space")
    }


def test_same_source_same_hash_and_already_published(tmp_path: Path) -> None:
    npy_source(tmp_path / "a.npy")
    first = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    again = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    assert again.already_published and again.path == first.path
    np.save(tmp_path / "a.npy", np.ones((11, 3, 5, 8), np.float32))  # changed: another cache
    other = convert(tmp_path / "a.npy", root=tmp_path / "root", durable=False)
    assert other.path != first.path
    assert json.loads((other.path / "metadata.json").read_text())["data"]["converted_from"]["kind"] == "npy"
