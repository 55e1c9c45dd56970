"""protocol.float8: the float8_e4m3 rule written out, the error it allows, and the scales a
cache may hold (checked by their bits, named in words)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.errors import DtypeRangeError, ScaleError
from saev_shards.protocol import float8

vectors = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=8),
    elements=st.floats(-(2.0**100), 2.0**100, width=32),
)


@given(vectors)
def test_the_round_trip_stays_within_the_bound_and_the_scales_are_plain(x: np.ndarray[Any, Any]) -> None:
    values, scales = float8.reference_quantize(x)
    assert values.shape == x.shape and values.dtype == float8.FLOAT8_DTYPE
    assert scales.shape == x.shape[:-1] and scales.dtype == np.float32
    assert float8.scales_plain(scales)
    back = float8.reference_dequantize(values, scales)
    assert (np.abs(back.astype(np.float64) - x) <= float8.error_bound(x, scales)).all()
    largest = np.abs(x).max(axis=-1)
    np.testing.assert_array_equal(scales, (largest / np.float32(448)).astype(np.float32))


def test_zero_and_nan_vectors() -> None:
    x = np.array([[0.0, 0.0], [1.0, np.nan], [np.inf, 1.0]], np.float32)
    values, scales = float8.reference_quantize(x)
    codes = values.view(np.uint8)
    assert codes[0].tolist() == [0, 0] and scales[0] == 0
    assert codes[1].tolist() == codes[2].tolist() == [float8.NAN_BYTE] * 2
    assert (scales[1:].view(np.uint32) == float8.NAN_SCALE_BITS).all()
    assert np.isnan(float8.reference_dequantize(values, scales)[1:]).all()
    bf16 = float8.reference_dequantize(values, scales, "bfloat16")
    assert bf16.dtype == np.uint16 and (bf16[1:] == 0x7FC0).all()
    with pytest.raises(TypeError, match="expected floating-point activations"):
        float8.reference_quantize(np.arange(3))
    with pytest.raises(ValueError, match="dtype: expected one of"):
        float8.reference_dequantize(values, scales, "float64")


ODD = {
    "inf": np.inf,
    "-inf": -np.inf,
    "-2.5 (negative)": -2.5,
    "-0.0 (negative zero)": -0.0,
    f"1e+38 (above {float(float8.MAX_SCALE):.7g})": 1e38,
    "NaN 0xffc00000": -np.nan,
}


def test_odd_scales_are_found_by_their_bits_and_named() -> None:
    scales = np.array([0.0, 1.0, float8.MAX_SCALE, *ODD.values(), np.nan], np.float32)
    assert not float8.scales_plain(scales)
    assert float8.scales_plain(scales[:3])
    odd, nan = float8.odd_scales(scales)
    assert odd.tolist() == list(range(3, 3 + len(ODD)))
    assert nan.tolist() == [len(scales) - 1]
    assert [float8.describe_scale(scales[i]) for i in odd] == list(ODD)
    assert float8.describe_scale(np.float32(np.nan)) == "NaN 0x7fc00000 (a vector stored as NaN has bytes 0x7f)"
    assert float8.scales_plain(np.broadcast_to(np.array([[1.0], [2.0]], np.float32), (2, 5)))  # one per value


def test_check_range_names_the_first_odd_scale_and_what_does_not_fit() -> None:
    float8.check_range(np.array([], np.float32), "float16")
    with pytest.raises(
        ScaleError, match=r"^shard 3: float8_e4m3 scales: expected \+0\.0.*found inf at position 1 of 3 \(1 more\)"
    ):
        float8.check_range(np.array([1.0, np.inf, -1.0], np.float32), "float32", "shard 3: ")
    fits16 = np.array([65504 / 448, np.nan], np.float32)
    float8.check_range(fits16, "float16")
    with pytest.raises(DtypeRangeError, match="do not fit float16"):
        float8.check_range(np.array([65520 / 448], np.float32), "float16")
    float8.check_range(np.array([1e30], np.float32), "bfloat16")
    with pytest.raises(DtypeRangeError, match="do not fit bfloat16"):
        float8.check_range(np.array([float8.MAX_SCALE], np.float32), "bfloat16")
    float8.check_range(np.array([float8.MAX_SCALE], np.float32), "float32")
