"""numpy-style indexing of Shards equals numpy indexing of the logical tensor, errors included."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards._indexing import CACHE_RANGE, wrap_index

from ..support import strategies
from ..support.caches import small_metadata, write_cache


@pytest.fixture(scope="module")
def cache() -> Iterator[tuple[ss.Shards, np.ndarray[Any, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        md = small_metadata()  # 23 examples, 5 per shard: a partial last shard of 3
        logical = write_cache(Path(tmp), md, batches=[4])
        yield ss.open(Path(tmp) / md.hash), logical


def outcome(obj: Any, key: Any) -> tuple[str, Any]:
    try:
        return "ok", obj[key]
    except IndexError:
        return "IndexError", None


@st.composite
def keys(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    n = draw(st.integers(1, 4))
    comps = [draw(strategies.index_component(size)) for size in shape[:n]]
    if draw(st.booleans()) and n < 4:
        pos = draw(st.integers(0, n))
        comps.insert(pos, Ellipsis)
    return comps[0] if len(comps) == 1 and draw(st.booleans()) else tuple(comps)


@given(data=st.data())
def test_indexing_matches_numpy(cache: tuple[ss.Shards, Any], data: st.DataObject) -> None:
    shards, logical = cache
    key = data.draw(keys(logical.shape))
    expected = outcome(logical, key)
    got = outcome(shards, key)
    assert got[0] == expected[0], f"key {key!r}"
    if expected[0] == "ok":
        assert got[1].shape == expected[1].shape, f"key {key!r}"
        np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize(
    "key",
    [
        0,
        -1,
        22,
        (3, 1),
        (3, 1, 4),
        (3, 1, 4, 7),
        slice(None),
        slice(3, 17),
        slice(3, 17, 2),
        slice(None, None, -1),
        slice(21, 2, -3),
        slice(4, 6),  # crosses the boundary between shards 0 and 1
        slice(20, 23),  # the partial last shard
        slice(30, 40),  # empty
        [0, 22, 5, 5, -1],
        np.array([[1, 2], [20, 3]]),
        ([1, 7, 12], [0, 1, 1]),  # paired with the layer axis
        ([1, 7, 12], slice(None), [0, 2, 4]),  # non-adjacent advanced indices
        (slice(2, 9), [1, 0]),
        (slice(2, 9), [1, 0], slice(None), [3, 4]),  # slice axis moves behind the advanced dims
        (slice(2, 9), [1, 0], 0),
        (slice(2, 9), 1, slice(None), [3, 4]),
        (0, [1, 0], slice(None), [3, 4]),
        (Ellipsis, 3),
        (5, Ellipsis, 2),
        (np.arange(23) % 3 == 0,),
        (slice(None), np.array([True, False])),
        (np.int64(7), np.int32(1)),
        ([], slice(None)),
    ],
)
def test_indexing_examples(cache: tuple[ss.Shards, Any], key: Any) -> None:
    shards, logical = cache
    expected = logical[key]
    got = shards[key]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "key",
    [23, -24, (0, 2), (0, 0, 5), [0, 23], (0, 0, 0, 0, 0), ([1, 2, 3], [0, 1]), (np.ones(5, bool),), 1.5, "x"],
)
def test_indexing_errors_are_index_errors(cache: tuple[ss.Shards, Any], key: Any) -> None:
    shards, logical = cache
    with pytest.raises(IndexError):
        _ = logical[key]
    with pytest.raises(IndexError):
        _ = shards[key]


def test_newaxis_is_rejected_with_a_hint(cache: tuple[ss.Shards, Any]) -> None:
    shards, _ = cache
    with pytest.raises(IndexError, match="newaxis is not supported"):
        _ = shards[None]


def test_views_are_read_only_and_zero_copy_within_a_shard(cache: tuple[ss.Shards, Any]) -> None:
    shards, _ = cache
    view = shards[1:4]
    assert not view.flags.writeable
    assert np.shares_memory(view, shards.shard(0))
    example = shards.example(7, 11)
    assert np.shares_memory(example, shards.shard(1))
    with pytest.raises(ValueError, match="read-only"):
        example[0, 0] = 1


@given(st.integers(-30, 30), st.integers(0, 12))
def test_wrap_index_is_python_sequence_indexing(index: int, n: int):
    items = list(range(n))
    try:
        expected: Any = items[index]
    except IndexError:
        expected = IndexError
    if expected is IndexError:
        with pytest.raises(IndexError, match=rf"^example {index} out of range \[0, {n}\)$"):
            wrap_index(index, n, "example")
    else:
        assert wrap_index(index, n, "example") == expected


def test_wrap_index_words_the_range_given():
    with pytest.raises(IndexError, match=r"^example -24 out of range for a cache of 23 examples$"):
        wrap_index(-24, 23, "example", CACHE_RANGE)
