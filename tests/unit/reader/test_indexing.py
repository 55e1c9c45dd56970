"""numpy-style indexing of Shards equals numpy indexing of the logical tensor, errors included;
for float8_e4m3 caches the stored values, their scales and the values read (dequantized)
equal numpy indexing of the logical tensors of each."""

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
from saev_shards.codecs import float8
from saev_shards.reader.indexing import CACHE_RANGE, wrap_index

from ...support import strategies
from ...support.caches import float_input, small_metadata, write_cache


@pytest.fixture(scope="module")
def cache() -> Iterator[tuple[ss.Shards, np.ndarray[Any, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        md = small_metadata()  # 23 examples, 5 per shard: a partial last shard of 3
        logical = write_cache(Path(tmp), md, batches=[4])
        yield ss.open(Path(tmp) / md.hash), logical


@pytest.fixture(scope="module")
def cache8() -> Iterator[tuple[ss.Shards, np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """A float8_e4m3 cache of the same shape: the values read, the stored values and the scales
    as logical tensors ``(N, L, T, D)``, ``(N, L, T, D)`` and ``(N, L, T)``."""
    with tempfile.TemporaryDirectory() as tmp:
        md = small_metadata(dtype="float8_e4m3")
        logical = write_cache(Path(tmp), md, batches=[4])
        stored, scales = float8.quantize_numpy(float_input(md, logical))
        yield ss.open(Path(tmp) / md.hash), logical, stored, scales


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


@given(data=st.data())
def test_float8_indexing_of_values_stored_values_and_scales_matches_numpy(
    cache8: tuple[ss.Shards, Any, Any, Any], data: st.DataObject
) -> None:
    """The scale of every value is found by the same offset arithmetic as the value: indexing the
    cache, its stored values and its scales equals numpy indexing of the logical tensors."""
    shards, logical, stored, scales = cache8
    key = data.draw(keys(logical.shape))
    expected = outcome(logical, key)
    for got in (outcome(shards, key), outcome(shards.raw, key)):
        assert got[0] == expected[0], f"key {key!r}"
    if expected[0] == "ok":
        np.testing.assert_array_equal(shards[key], expected[1])
        np.testing.assert_array_equal(shards.raw[key].view(np.uint8), stored[key].view(np.uint8))
        np.testing.assert_array_equal(shards.with_dtype("float32")[key], expected[1].astype(np.float32))
    scale_key = data.draw(keys(scales.shape))
    want = outcome(scales, scale_key)
    assert shards.scales is not None
    got = outcome(shards.scales, scale_key)
    assert got[0] == want[0], f"key {scale_key!r}"
    if want[0] == "ok":
        assert got[1].shape == want[1].shape and got[1].dtype == np.float32
        np.testing.assert_array_equal(got[1], want[1])


@given(data=st.data())
def test_float8_locate_and_locate_scale_are_offset_arithmetic(
    cache8: tuple[ss.Shards, Any, Any, Any], data: st.DataObject
) -> None:
    """``locate`` and ``locate_scale`` give the byte of a vector and of its scale in their
    files: offset_in_vectors * D and offset_in_vectors * 4 (protocol.md 4)."""
    shards, _, stored, scales = cache8
    md = shards.metadata
    e = data.draw(st.integers(0, md.n_examples - 1))
    layer = data.draw(st.sampled_from(md.layers))
    t = data.draw(st.integers(0, md.tokens_per_ex - 1))
    li = md.layer_index(layer)
    k, offset = shards.locate(e, layer, t)
    k2, scale_offset = shards.locate_scale(e, layer, t)
    assert k == k2 and offset == scale_offset // 4 * md.d_model
    vector = (shards.path / f"acts{k:06d}.bin").read_bytes()[offset : offset + md.d_model]
    assert vector == stored[e, li, t].view(np.uint8).tobytes()
    scale = (shards.path / f"scales{k:06d}.bin").read_bytes()[scale_offset : scale_offset + 4]
    assert np.frombuffer(scale, "<f4")[0] == scales[e, li, t]


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
