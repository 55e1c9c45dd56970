"""Write then read: every access path equals plain numpy indexing of the logical tensor."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss

from ..support import strategies
from ..support.caches import labels_for, small_metadata, split, tree_bytes, write_cache


@given(strategies.metadata(), strategies.batch_sizes(), st.data())
def test_round_trip(md: ss.Metadata, batches: list[int], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        logical = write_cache(root, md, batches=batches, labels=True, background=data.draw(st.booleans()))
        shards = ss.open(root / md.hash)
        assert shards.shape == logical.shape
        assert shards.metadata == md
        np.testing.assert_array_equal(shards[:], logical)
        if md.n_examples:
            labels = shards.labels
            assert labels is not None
            np.testing.assert_array_equal(labels, labels_for(md))
        for _ in range(min(5, md.n_examples)):
            ex = data.draw(st.integers(0, md.n_examples - 1))
            li = data.draw(st.integers(0, md.n_layers - 1))
            tok = data.draw(st.integers(0, md.tokens_per_ex - 1))
            layer = md.layers[li]
            np.testing.assert_array_equal(shards.get(ex, layer, tok), logical[ex, li, tok])
            np.testing.assert_array_equal(shards.example(ex, layer), logical[ex, li])
            np.testing.assert_array_equal(shards.read_example(ex, li), logical[ex, li])
            # locate() is where the bytes really are in the file.
            k, offset = shards.locate(ex, layer, tok)
            raw = np.fromfile(shards.shard_path(k), dtype=md.numpy_dtype, count=md.d_model, offset=offset)
            if md.dtype == "float8_e4m3":  # and locate_scale() where its scale is: float32(q) * s
                k, offset = shards.locate_scale(ex, layer, tok)
                scale = np.fromfile(shards.scale_path(k), dtype="<f4", count=1, offset=offset)
                raw = (raw.astype(np.float32) * scale).astype(np.float16)
            np.testing.assert_array_equal(raw, logical[ex, li, tok])
        a = data.draw(st.integers(0, md.n_examples))
        b = data.draw(st.integers(a, md.n_examples))
        np.testing.assert_array_equal(shards.read_range(a, b), logical[a:b])
        picks = data.draw(st.lists(st.integers(0, max(0, md.n_examples - 1)), max_size=6)) if md.n_examples else []
        layers_idx = [i % md.n_layers for i in range(len(picks))]
        np.testing.assert_array_equal(shards.read_examples(picks, layers_idx), logical[picks, layers_idx])
        assert shards.verify() == sum(n for _, n, _ in shards.manifest.files())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3"])
@pytest.mark.parametrize("n_examples", [0, 1, 5, 23])
def test_dtype_by_size_matrix(root: Path, dtype: str, n_examples: int) -> None:
    md = small_metadata(dtype=dtype, n_examples=n_examples)
    logical = write_cache(root, md, batches=[4])
    shards = ss.open(root / md.hash)
    assert shards[:].dtype == (np.float16 if dtype == "float8_e4m3" else md.numpy_dtype)
    assert shards.raw[:].dtype == md.numpy_dtype
    np.testing.assert_array_equal(shards[:], logical)
    assert [e.n_examples for e in shards.manifest.shards] == [md.shard_n_examples(k) for k in range(md.n_shards)]
    for k, entry in enumerate(shards.manifest.shards):
        assert os.path.getsize(shards.shard_path(k)) == entry.nbytes == md.shard_n_examples(k) * md.example_nbytes


def test_one_example_one_layer_one_token(root: Path) -> None:
    md = small_metadata(layers=(3,), patches_per_ex=1, cls_token=False, n_examples=1, patches_per_shard=1, d_model=1)
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    assert shards.shape == (1, 1, 1, 1)
    assert shards.get(0, 3, 0).tolist() == logical[0, 0, 0].tolist()


def test_last_shard_of_one_example(root: Path) -> None:
    md = small_metadata(n_examples=21)  # 5 per shard: 4 full shards and one of a single example
    logical = write_cache(root, md, batches=[21])
    shards = ss.open(root / md.hash)
    assert shards.manifest.shards[-1].n_examples == 1
    np.testing.assert_array_equal(shards[20], logical[20])


@given(batches_a=strategies.batch_sizes(), batches_b=strategies.batch_sizes(), background=st.booleans())
def test_deterministic_bytes_whatever_the_batching(
    batches_a: list[int], batches_b: list[int], background: bool
) -> None:
    """Same input, byte-identical output: shards, labels, columns, text and stats."""
    md = small_metadata()
    lengths = np.arange(md.n_examples, dtype=np.int32) % (md.tokens_per_ex + 1)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        kwargs = dict(labels=True, lengths=lengths, text=True, stats=True)
        write_cache(Path(a), md, batches=batches_a, background=background, **kwargs)  # type: ignore[arg-type]
        write_cache(Path(b), md, batches=batches_b, background=not background, **kwargs)  # type: ignore[arg-type]
        assert tree_bytes(Path(a) / md.hash) == tree_bytes(Path(b) / md.hash)


def test_columns_text_and_stats(root: Path) -> None:
    md = small_metadata()
    lengths = (np.arange(md.n_examples) % md.tokens_per_ex + 1).astype(np.int32)
    logical = write_cache(root, md, lengths=lengths, text=True, stats=True)
    shards = ss.open(root / md.hash)
    np.testing.assert_array_equal(shards.lengths, lengths)
    assert shards.columns["lengths"].dtype == np.int32
    prompts = shards.text("prompt")
    assert len(prompts) == md.n_examples
    assert prompts[7] == "example 7: é"
    assert prompts[-1] == f"example {md.n_examples - 1}: é"
    assert list(prompts)[3] == "example 3: é"
    with pytest.raises(KeyError, match="no text field 'missing'"):
        shards.text["missing"]
    stats = shards.stats
    assert stats is not None
    # Reference statistics over valid (non-padding) tokens, in float64.
    x = logical.astype(np.float64)
    valid = np.arange(md.tokens_per_ex)[None, :] < lengths[:, None]  # (N, T)
    for li in range(md.n_layers):
        tokens = x[:, li][valid]  # (n_valid, D)
        assert stats["count"][li] == len(tokens)
        np.testing.assert_allclose(stats["mean"][li], tokens.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats["var"][li], tokens.var(axis=0), rtol=1e-4, atol=1e-5)
        norms = np.linalg.norm(tokens, axis=1)
        np.testing.assert_allclose(stats["norm_mean"][li], norms.mean(), rtol=1e-5)
        np.testing.assert_allclose(stats["norm_sq_mean"][li], (norms**2).mean(), rtol=1e-5)
        assert stats["nonfinite"][li] == 0
    assert stats["layers"].tolist() == list(md.layers)


def test_stats_count_nonfinite_when_allowed(root: Path) -> None:
    md = small_metadata(n_examples=5)
    acts = np.zeros(md.shape, np.float32)
    acts[2, 1, 3, 0] = 1e6  # overflows float16
    acts[4, 0, 0, 5] = np.nan
    with ss.ShardWriter(root, md, allow_nonfinite=True, stats=True, durable=False) as w:
        w.write(acts)
    shards = ss.open(root / md.hash)
    assert np.isinf(shards.get(2, 11, 3)[0])
    stats = shards.stats
    assert stats is not None
    assert stats["nonfinite"].tolist() == [1, 1]
    assert stats["count"].tolist() == [5 * 5 - 1, 5 * 5 - 1]
    assert np.isfinite(stats["mean"]).all()


def test_split_helper() -> None:
    assert split(5, [2]) == [(0, 2), (2, 4), (4, 5)]
    assert split(0, [3]) == []
