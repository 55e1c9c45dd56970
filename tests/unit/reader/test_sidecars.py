"""reader.sidecars: a cache's columns and text fields, mappings by name whose misses name what the cache has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss

from ...support.caches import small_metadata, write_cache


@pytest.fixture
def cache(tmp_path: Path) -> tuple[ss.Shards, np.ndarray]:
    md = small_metadata(n_examples=7)  # layers (6, 11)
    lengths = np.full(md.n_examples, md.tokens_per_ex, np.int32)
    logical = write_cache(tmp_path, md, lengths=lengths, text=True)
    return ss.open(tmp_path / md.hash), logical


def test_columns_and_text_are_mappings_by_name(cache: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = cache
    assert list(shards.columns) == ["lengths"] and list(shards.text) == ["prompt"]
    assert shards.text["prompt"][2] == "example 2: é"
    assert shards.text("prompt")[2] == "example 2: é"  # the spelling of earlier versions
    assert shards.columns("lengths") is shards.columns["lengths"]
    assert "nope" not in shards.columns and shards.columns.get("nope") is None
    with pytest.raises(ss.NameNotFoundError, match=r"no column 'nope'; this cache has columns \['lengths'\]") as err:
        shards.columns["nope"]
    assert isinstance(err.value, KeyError) and str(err.value).startswith(str(shards.path))
    with pytest.raises(ss.NameNotFoundError, match=r"no text field 'id'; this cache has text fields \['prompt'\]"):
        shards.text["id"]


def test_a_cache_without_columns_says_so(tmp_path: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(tmp_path, md)
    shards = ss.open(tmp_path / md.hash)
    with pytest.raises(KeyError, match="this cache has no columns"):
        shards.columns["lengths"]
    assert shards.lengths is None
