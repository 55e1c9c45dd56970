"""reader.reads: the read paths by example and by vector, into the caller's buffers or fresh
ones, against numpy indexing of what was written."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss

from ...support import strategies
from ...support.caches import small_metadata, write_cache


def test_read_example_buffers_and_errors(root: Path) -> None:
    md = small_metadata()
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    a = np.empty(md.shape[2:], md.numpy_dtype)
    b = np.empty(md.shape[2:], md.numpy_dtype)
    for ex in (0, 22, -1, 7):
        assert shards.read_example(ex, 1, a) is a
        np.testing.assert_array_equal(a, logical[ex, 1])
        shards.read_example(ex - 1, 0, b)  # alternating buffers never share a cached view
        np.testing.assert_array_equal(b, logical[ex - 1, 0])
        np.testing.assert_array_equal(a, logical[ex, 1])
    with pytest.raises(IndexError, match="example 23 out of range"):
        shards.read_example(23, 0)
    with pytest.raises(IndexError, match=r"layer index 2 out of range \[0, 2\)"):
        shards.read_example(0, 2)
    with pytest.raises(ValueError, match="out must be a C-contiguous float16 array of 80 bytes"):
        shards.read_example(0, 0, np.empty((4, 8), np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        shards.read_example(0, 0, np.empty((8, 5), np.float16).T)
    # Another float dtype: the values converted into it; one that is not a float dtype: refused.
    wide = np.empty((5, 8), np.float32)
    assert shards.read_example(3, 1, wide) is wide
    np.testing.assert_array_equal(wide, logical[3, 1].astype(np.float32))
    np.testing.assert_array_equal(shards.read_example(3, 1, dtype="float32"), wide)
    with pytest.raises(ValueError, match=r"out: expected a float16 array \(the stored values\) or one of"):
        shards.read_example(0, 0, np.empty((5, 8), np.int32))


@given(strategies.metadata(min_examples=1), st.data())
def test_read_vectors_matches_numpy(md: ss.Metadata, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        logical = write_cache(Path(tmp), md, batches=[5])
        shards = ss.open(Path(tmp) / md.hash)
        n = data.draw(st.integers(0, 40))
        ex = data.draw(st.lists(st.integers(0, md.n_examples - 1), min_size=n, max_size=n))
        li = data.draw(st.lists(st.integers(0, md.n_layers - 1), min_size=n, max_size=n))
        tok = data.draw(st.lists(st.integers(0, md.tokens_per_ex - 1), min_size=n, max_size=n))
        np.testing.assert_array_equal(shards.read_vectors(ex, li, tok), logical[ex, li, tok].reshape(n, md.d_model))


def test_read_vectors_runs_duplicates_and_errors(root: Path) -> None:
    md = small_metadata()
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    # Every token of two examples (runs of adjacent vectors, one crossing into the next layer), in a
    # shuffled order, plus duplicates: one scattering preadv per run.
    ex = np.repeat([3, 4, 3], 10)
    li = np.tile(np.repeat([0, 1], 5), 3)
    tok = np.tile(np.arange(5), 6)
    perm = np.random.default_rng(0).permutation(len(ex))
    got = shards.read_vectors(ex[perm], li[perm], tok[perm])
    np.testing.assert_array_equal(got, logical[ex[perm], li[perm], tok[perm]])
    one_layer = shards.read_vectors(np.arange(23), 1, 0)  # broadcasting scalars
    np.testing.assert_array_equal(one_layer, logical[:, 1, 0])
    assert shards.read_vectors([], [], []).shape == (0, md.d_model)
    with pytest.raises(IndexError, match=r"example 23 out of range \[0, 23\)"):
        shards.read_vectors([23], [0], [0])
    with pytest.raises(IndexError, match=r"token 5 out of range \[0, 5\)"):
        shards.read_vectors([0], [0], [5])
    with pytest.raises(ValueError, match="out must be a C-contiguous float16 array of shape"):
        shards.read_vectors([0], [0], [0], out=np.empty((2, 8), np.float16))
    wide = shards.read_vectors([0, 5], [0, 1], [0, 4], out=np.empty((2, 8), np.float32))
    np.testing.assert_array_equal(wide, logical[[0, 5], [0, 1], [0, 4]].astype(np.float32))
