"""codecs.bfloat16: rounding to bfloat16 as torch does (nearest, ties to even), widening exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.codecs.bfloat16 import bf16_to_float32, float32_to_bf16, round_bfloat16

floats32 = hnp.arrays(np.float32, st.integers(0, 40), elements=st.floats(width=32, allow_nan=False))


@given(floats32)
def test_rounding_is_torchs_bit_for_bit(x: np.ndarray[Any, Any]) -> None:
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bf16(x), want)


@given(hnp.arrays(np.uint16, st.integers(0, 40)))
def test_widening_is_exact_and_rounding_gives_the_bits_back(raw: np.ndarray[Any, Any]) -> None:
    wide = bf16_to_float32(raw)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.view(np.uint32) >> 16, raw)
    finite = ~np.isnan(wide)
    np.testing.assert_array_equal(float32_to_bf16(wide)[finite], raw[finite])


def test_ties_go_to_even_and_nan_is_the_quiet_nan() -> None:
    one = np.float32(1.0).view(np.uint32)
    halfway = np.array([one + 0x8000, one + 0x18000], np.uint32).view(np.float32)  # 1 + half an ulp, 1 + 1.5 ulps
    assert float32_to_bf16(halfway).tolist() == [0x3F80, 0x3F82]
    assert float32_to_bf16(np.array([np.nan, -np.nan, np.inf], np.float32)).tolist() == [0x7FC0, 0x7FC0, 0x7F80]


def test_round_bfloat16_writes_into_dest_from_any_float_input() -> None:
    wide = np.array([[1.0, 2.5], [-3.0, 0.0]], np.float32)
    dest = np.empty((2, 2), np.uint16)
    round_bfloat16(wide.copy(), dest)
    np.testing.assert_array_equal(bf16_to_float32(dest), wide)
    assert float32_to_bf16(np.array([0.5, 1])).tolist() == [0x3F00, 0x3F80]  # float64 values
