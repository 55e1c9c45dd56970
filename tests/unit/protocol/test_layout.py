"""Offset arithmetic (protocol.md sections 3-4) against plain numpy indexing of the logical tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.protocol import layout

from ...support import strategies


def flat_position(md: ss.Metadata, example: int, layer_idx: int, token: int) -> tuple[int, int]:
    """Reference: the vector's byte position via numpy's own C-order index arithmetic."""
    eps = md.examples_per_shard
    shard = example // eps
    shape = (md.shard_n_examples(shard), md.n_layers, md.tokens_per_ex, md.d_model)
    vec = np.ravel_multi_index((example - shard * eps, layer_idx, token, 0), shape)
    return shard, int(vec) * md.itemsize


@given(strategies.metadata(min_examples=1), st.data())
def test_locate_matches_numpy_ravel(md: ss.Metadata, data: st.DataObject) -> None:
    example = data.draw(st.integers(0, md.n_examples - 1))
    layer_idx = data.draw(st.integers(0, md.n_layers - 1))
    token = data.draw(st.integers(0, md.tokens_per_ex - 1))
    got = layout.locate(
        example,
        layer_idx,
        token,
        n_examples=md.n_examples,
        examples_per_shard=md.examples_per_shard,
        n_layers=md.n_layers,
        tokens=md.tokens_per_ex,
        vector_nbytes=md.d_model * md.itemsize,
    )
    assert got == flat_position(md, example, layer_idx, token)


@given(strategies.metadata())
def test_shard_sizes_add_up(md: ss.Metadata) -> None:
    eps = md.examples_per_shard
    assert eps == md.patches_per_shard // (md.tokens_per_ex * md.n_layers)
    sizes = [md.shard_n_examples(k) for k in range(md.n_shards)]
    assert sum(sizes) == md.n_examples
    assert all(s == eps for s in sizes[:-1])
    assert not sizes or 1 <= sizes[-1] <= eps
    assert sum(md.shard_nbytes(k) for k in range(md.n_shards)) == md.nbytes


@given(
    n_examples=st.integers(1, 10**9),
    n_layers=st.integers(1, 48),
    tokens=st.integers(1, 4096),
    d_model=st.integers(1, 16384),
    itemsize=st.sampled_from([2, 4]),
    examples_per_shard=st.integers(1, 10**6),
    data=st.data(),
)
def test_huge_caches_exact_without_allocating(
    n_examples: int,
    n_layers: int,
    tokens: int,
    d_model: int,
    itemsize: int,
    examples_per_shard: int,
    data: st.DataObject,
) -> None:
    """Offsets beyond 2**31 and 2**32 bytes are exact: Python ints against an independent formula."""
    example = data.draw(st.integers(0, n_examples - 1))
    layer_idx = data.draw(st.integers(0, n_layers - 1))
    token = data.draw(st.integers(0, tokens - 1))
    shard, offset = layout.locate(
        example,
        layer_idx,
        token,
        n_examples=n_examples,
        examples_per_shard=examples_per_shard,
        n_layers=n_layers,
        tokens=tokens,
        vector_nbytes=d_model * itemsize,
    )
    global_vector = (example * n_layers + layer_idx) * tokens + token
    shard_start_vector = shard * examples_per_shard * n_layers * tokens
    assert offset == (global_vector - shard_start_vector) * d_model * itemsize
    assert 0 <= offset < examples_per_shard * n_layers * tokens * d_model * itemsize
    # The vectorised int64 variant agrees wherever int64 holds the answer.
    shards_v, offsets_v = layout.locate_many(
        [example],
        [layer_idx],
        [token],
        examples_per_shard=examples_per_shard,
        n_layers=n_layers,
        tokens=tokens,
        vector_nbytes=d_model * itemsize,
    )
    assert (int(shards_v[0]), int(offsets_v[0])) == (shard, offset)


def test_offsets_beyond_2_to_the_32() -> None:
    # A float16 ViT-L cache: 1024 dims, 257 tokens, 24 layers; shard of 4096 examples.
    shard, offset = layout.locate(
        4095, 23, 256, n_examples=10**6, examples_per_shard=4096, n_layers=24, tokens=257, vector_nbytes=2048
    )
    assert shard == 0
    assert offset == (4096 * 24 * 257 - 1) * 1024 * 2
    assert offset > 2**32


def test_examples_per_shard_zero_is_a_clear_error() -> None:
    with pytest.raises(ss.MetadataError, match=r"patches_per_shard=100 is too small.*197 \* 2 = 394"):
        layout.examples_per_shard(100, 197, 2)


@pytest.mark.parametrize(("example", "layer_idx", "token"), [(-1, 0, 0), (10, 0, 0), (0, 2, 0), (0, 0, 5)])
def test_locate_rejects_out_of_range(example: int, layer_idx: int, token: int) -> None:
    with pytest.raises(IndexError):
        layout.locate(
            example, layer_idx, token, n_examples=10, examples_per_shard=3, n_layers=2, tokens=5, vector_nbytes=8
        )


def test_shard_n_examples_out_of_range() -> None:
    with pytest.raises(IndexError, match="shard 4 out of range"):
        layout.shard_n_examples(4, 10, 3)


def test_the_earlier_keywords_still_give_the_same_offsets() -> None:
    """``eps`` (examples_per_shard) and ``d_model`` with ``itemsize`` (vector_nbytes): the
    keywords of earlier releases."""
    sizes = {"n_layers": 3, "tokens": 7}
    new = layout.locate(41, 2, 5, n_examples=50, examples_per_shard=6, vector_nbytes=96, **sizes)
    earlier = layout.locate(41, 2, 5, n_examples=50, eps=6, d_model=48, itemsize=2, **sizes)  # type: ignore[call-arg]
    assert earlier == new == (6, 11904)  # (5 * 3 * 7 + 2 * 7 + 5) vectors of 96 bytes
    many = layout.locate_many([41], [2], [5], eps=6, d_model=48, itemsize=2, **sizes)  # type: ignore[call-arg]
    assert [int(many[0][0]), int(many[1][0])] == list(new)
    assert layout.shard_of(41, eps=6) == layout.shard_of(41, examples_per_shard=6) == (6, 5)  # type: ignore[call-arg]
    assert layout.n_shards(50, eps=6) == 9  # type: ignore[call-arg]
    assert layout.shard_n_examples(8, 50, eps=6) == 2  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="both eps and examples_per_shard"):
        layout.shard_of(41, eps=6, examples_per_shard=6)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="d_model and itemsize together"):
        layout.locate(41, 2, 5, n_examples=50, eps=6, d_model=48, **sizes)  # type: ignore[call-arg]
