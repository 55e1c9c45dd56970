"""A plain-numpy model of what `saev_shards.shuffle` must write, and a check against it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

import saev_shards as ss
from saev_shards.codecs import dtypes, float8
from saev_shards.protocol.common import FLOAT8
from saev_shards.shuffle import CLS_LABEL, shuffle_order


@dataclasses.dataclass
class Expected:
    """Every row of a shuffled cache: where it came from and its values."""

    examples: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    acts: npt.NDArray[Any]  # (n, L, D) as the output reads them back (float16 for float8_e4m3)
    labels: npt.NDArray[np.uint8] | None


def expected_shuffle(
    md: ss.Metadata,
    logical: npt.NDArray[Any],
    *,
    layers: tuple[int, ...] | None = None,
    tokens: str = "content",
    lengths: npt.NDArray[Any] | None = None,
    labels: npt.NDArray[np.uint8] | None = None,
    seed: int = 0,
    dtype: str | None = None,
) -> Expected:
    """The chosen ``(example, token)`` pairs in source order, permuted by `shuffle_order`."""
    cls = int(md.cls_token)
    if tokens == "content":
        positions = list(range(cls, md.tokens_per_ex))
    elif tokens == "cls":
        positions = [0]
    else:
        positions = list(range(md.tokens_per_ex))
    pairs = [
        (e, t) for e in range(md.n_examples) for t in positions if lengths is None or t < int(lengths[e])
    ]  # fmt: skip
    source = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    order = shuffle_order(len(source), seed)
    ex, tok = source[order, 0], source[order, 1]
    layer_positions = [i for i, v in enumerate(md.layers) if layers is None or v in layers]
    acts = logical[ex][:, layer_positions][np.arange(len(ex)), :, tok]  # (n, L, D)
    out_dtype = dtype or md.dtype
    if out_dtype != md.dtype:
        # A float8_e4m3 source's logical tensor holds its dequantized values (exact in float16).
        wide = acts.astype(np.float32) if md.dtype == FLOAT8 else dtypes.to_float32(acts, md.dtype)
        if out_dtype == FLOAT8:
            acts = float8.dequantize(*float8.quantize_numpy(wide), "float16")
        else:
            acts, _ = dtypes.to_stored(wide, out_dtype)
    expected_labels = None
    if labels is not None:
        expected_labels = np.full(len(ex), CLS_LABEL, dtype=np.uint8)
        content = tok >= cls
        expected_labels[content] = labels[ex[content], tok[content] - cls]
    return Expected(ex, tok, acts, expected_labels)


def check_shuffled(shuffled: ss.Shards, expected: Expected) -> None:
    """The cache holds exactly the expected rows, in order, with their provenance."""
    md = shuffled.metadata
    n = len(expected.examples)
    assert md.shape == (n, expected.acts.shape[1] if n else md.n_layers, 1, md.d_model)
    assert (md.patches_per_ex, md.cls_token) == (1, False)
    if n == 0:  # an empty cache has no per-example files at all (ShardWriter writes none)
        assert shuffled.n_shards == 0
        return
    np.testing.assert_array_equal(np.asarray(shuffled.columns["source_example"]), expected.examples)
    np.testing.assert_array_equal(np.asarray(shuffled.columns["source_token"]), expected.tokens)
    np.testing.assert_array_equal(shuffled[:][:, :, 0], expected.acts)
    if expected.labels is None:
        assert shuffled.labels is None
    else:
        assert shuffled.labels is not None
        np.testing.assert_array_equal(np.asarray(shuffled.labels)[:, 0], expected.labels)
