"""convert.registry: the kind of each source is detected."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from saev_shards.convert import detect
from saev_shards.errors import ConvertOptionError

from ...support.sources import npy_source, pickle_source, saelens_source, zarr_source

pytest.importorskip("zarr")


warnings.filterwarnings("ignore", message="Consolidated metadata")


def test_each_kind_is_detected(tmp_path: Path) -> None:
    pickle_source(tmp_path / "pickle")
    zarr_source(tmp_path / "zarr")
    npy_source(tmp_path / "a.npy")
    assert detect(tmp_path / "pickle").name == "pickle"
    assert detect(tmp_path / "zarr").name == "zarr"
    assert detect(tmp_path / "a.npy").name == "npy"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(ConvertOptionError, match="not a source kind convert recognises; name one with --from"):
        detect(tmp_path / "other")
    if pytest.importorskip("datasets"):
        saelens_source(tmp_path / "saelens")
        assert detect(tmp_path / "saelens").name == "saelens"
