"""statistics: per-layer sums over every valid token, the same bits for any batching, the
non-finite tokens counted and left out, and the stats.json summary."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.codecs import float8
from saev_shards.codecs.bfloat16 import float32_to_bf16
from saev_shards.statistics import StatsAccumulator, example_sums

L, T, D = 2, 3, 4


def stored(x: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    return float32_to_bf16(x) if dtype == "bfloat16" else x.astype(dtype)


@given(
    n=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    with_lengths=st.booleans(),
    nonfinite=st.booleans(),
    cuts=st.lists(st.integers(0, 9), max_size=3),
)
def test_the_sums_are_the_same_bits_for_any_batching(
    n: int, seed: int, dtype: str, with_lengths: bool, nonfinite: bool, cuts: list[int]
) -> None:
    rng = np.random.default_rng(seed)
    acts = stored(rng.standard_normal((n, L, T, D)).astype(np.float32), dtype)
    if nonfinite:
        acts[rng.integers(n), rng.integers(L), rng.integers(T), rng.integers(D)] = stored(
            np.array([np.nan], np.float32), dtype
        )[0]
    lengths = rng.integers(0, T + 2, n) if with_lengths else None  # beyond T: every token
    whole = StatsAccumulator(L, D)
    whole.update(acts, dtype, lengths)
    pieces = StatsAccumulator(L, D)
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    for a, b in itertools.pairwise(bounds):
        pieces.update(acts[a:b], dtype, None if lengths is None else lengths[a:b])
    assert pieces.to_json() == whole.to_json()
    one_by_one = StatsAccumulator(L, D)
    for i in range(n):
        one_by_one.add_sums(example_sums(acts[i : i + 1], dtype, None if lengths is None else lengths[i : i + 1]))
    assert one_by_one.to_json() == whole.to_json()


def test_the_sums_are_those_of_the_valid_finite_tokens() -> None:
    acts = np.arange(2 * L * T * D, dtype=np.float32).reshape(2, L, T, D) / 10
    acts[1, 0, 0, 2] = np.inf
    lengths = np.array([3, 2])
    stats = StatsAccumulator(L, D)
    stats.update(acts, "float32", lengths)
    valid = np.arange(T)[None, :] < lengths[:, None]  # (2, T)
    for li in range(L):
        keep = valid & np.isfinite(acts[:, li]).all(axis=2)
        tokens = acts[:, li][keep].astype(np.float64)  # (count, D)
        assert stats.count[li] == len(tokens)
        assert stats.nonfinite[li] == (1 if li == 0 else 0)
        np.testing.assert_allclose(stats.sum[li], tokens.sum(axis=0), rtol=1e-6)
        np.testing.assert_allclose(stats.sum_sq[li], (tokens**2).sum(axis=0), rtol=1e-6)
        np.testing.assert_allclose(stats.norm_sum[li], np.linalg.norm(tokens, axis=1).sum(), rtol=1e-6)
        np.testing.assert_allclose(stats.norm_sq_sum[li], (tokens**2).sum(), rtol=1e-6)


def test_float8_values_are_summed_dequantized() -> None:
    x = np.random.default_rng(1).standard_normal((3, L, T, D)).astype(np.float32)
    q, scales = float8.quantize(x)
    from_float8, from_float32 = StatsAccumulator(L, D), StatsAccumulator(L, D)
    from_float8.update(q, "float8_e4m3", None, scales)
    from_float32.update(float8.dequantize(q, scales, "float32"), "float32", None)
    assert from_float8.to_json() == from_float32.to_json()


def test_json_round_trip_add_and_summary() -> None:
    a = StatsAccumulator(L, D)
    a.update(np.ones((2, L, T, D), np.float32) * 2, "float32", np.array([T, 1]))
    b = StatsAccumulator.from_json(a.to_json(), L, D)
    assert b.to_json() == a.to_json()
    b.add(a)
    assert b.count.tolist() == [2 * (T + 1)] * L
    summary = b.summary([6, 11])
    assert summary["layers"] == [6, 11] and summary["count"] == [8, 8] and summary["nonfinite"] == [0, 0]
    assert summary["mean"] == [[2.0] * D] * L and summary["var"] == [[0.0] * D] * L
    assert summary["norm_mean"] == [pytest.approx(4.0)] * L and summary["norm_sq_mean"] == [16.0] * L


def test_a_layer_without_tokens_summarises_as_zeros() -> None:
    stats = StatsAccumulator(L, D)
    stats.update(np.ones((1, L, T, D), np.float32), "float32", np.array([0]))
    summary = stats.summary([0, 1])
    assert summary["count"] == [0, 0]
    assert summary["mean"] == [[0.0] * D] * L and summary["norm_mean"] == [0.0, 0.0]
