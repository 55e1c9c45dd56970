"""codecs.dtypes: stored values to the dtypes they are read as, activations to stored dtypes,
non-finite checks by bits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.codecs import dtypes, float8
from saev_shards.codecs.bfloat16 import bf16_to_float32, float32_to_bf16

STORED = ["float16", "bfloat16", "float32"]


def stored(x: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    return float32_to_bf16(x) if dtype == "bfloat16" else x.astype(dtype)


@given(
    hnp.arrays(np.float32, (3, 4), elements=st.floats(-1000, 1000, width=32)),
    st.sampled_from(STORED),
    st.sampled_from(STORED),
)
def test_convert_is_the_cast_through_float32(x: np.ndarray[Any, Any], source: str, target: str) -> None:
    raw = stored(x, source)
    wide = dtypes.to_float32(raw, source)
    assert wide.dtype == np.float32
    got = dtypes.convert(raw, source, target)
    np.testing.assert_array_equal(got, stored(wide, target))
    assert got.dtype == dtypes.READ_DTYPES[target]
    if source == target:
        assert got is raw  # no copy without need
    out = np.empty(raw.shape, dtypes.READ_DTYPES[target])
    assert dtypes.convert(raw, source, target, out=out) is out
    np.testing.assert_array_equal(out, got)


def test_float8_needs_its_scales_and_is_dequantized() -> None:
    x = np.array([[1.0, -2.0, 0.5], [3.0, 0.0, 448.0]], np.float32)
    q, scales = float8.quantize(x)
    with pytest.raises(ValueError, match="need their scales"):
        dtypes.to_float32(q, "float8_e4m3")
    with pytest.raises(ValueError, match="need their scales"):
        dtypes.convert(q, "float8_e4m3", "float32")
    np.testing.assert_array_equal(dtypes.to_float32(q, "float8_e4m3", scales), float8.dequantize(q, scales, "float32"))
    bf16 = dtypes.convert(q, "float8_e4m3", "bfloat16", scales)
    np.testing.assert_array_equal(bf16_to_float32(bf16), float8.dequantize(q, scales, "float32"))


@pytest.mark.parametrize("dtype", STORED)
def test_to_stored_casts_and_says_whether_it_copied(dtype: str) -> None:
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    arr, owned = dtypes.to_stored(x, dtype)
    assert arr.flags.c_contiguous and arr.dtype.str == {"float16": "<f2", "bfloat16": "<u2", "float32": "<f4"}[dtype]
    np.testing.assert_array_equal(dtypes.to_float32(arr, dtype), x)
    assert owned == (dtype != "float32")
    if not owned:
        assert arr is x
    with pytest.raises(TypeError, match="expected floating-point activations, found dtype int64"):
        dtypes.to_stored(np.arange(4), dtype)


@pytest.mark.parametrize("dtype", STORED)
def test_torch_tensors_give_the_bytes_of_numpy_input(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6) / 7
    t = torch.from_numpy(x.copy())
    assert dtypes.is_torch_tensor(t) and not dtypes.is_torch_tensor(x)
    from_torch, _ = dtypes.to_stored(t.t().contiguous().t(), dtype)  # not contiguous: a copy
    np.testing.assert_array_equal(from_torch, dtypes.to_stored(x, dtype)[0])
    with pytest.raises(TypeError, match="expected floating-point activations"):
        dtypes.to_stored(torch.arange(3), dtype)


@given(st.sampled_from([*STORED, "float8_e4m3"]), st.integers(0, 300), st.data())
def test_nonfinite_checks_find_exactly_the_inf_and_nan(dtype: str, n: int, data: st.DataObject) -> None:
    bad = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=3)) if n else set()
    if dtype == "float8_e4m3":
        arr = np.full(n, 0x38, np.uint8)  # 1.0
        arr[list(bad)] = 0x7F  # NaN
    else:
        arr = stored(np.ones(n, np.float32), dtype)
        arr[list(bad)] = stored(np.array([np.inf], np.float32), dtype)[0]
    mask = dtypes.nonfinite_elements(arr, dtype)
    assert set(np.flatnonzero(mask).tolist()) == bad
    assert dtypes.nonfinite_mask_any(arr, dtype) == bool(bad)
