"""Dequantizing float8_e4m3 two ways, numba's compiled kernels (`codecs._float8_numba`) and numpy's
passes, each bit for bit ml_dtypes' value of every byte times its scale (protocol.md 5:
``RN32(float32(q) * s)``, then rounded to the output dtype), for every byte, scales across
float32's range, NaN codes and NaN scales, gathers of rows, and a thread that flushes
subnormal inputs to zero."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import saev_shards as ss
from saev_shards.codecs import _float8_passes, bfloat16, float8
from saev_shards.protocol.float8 import FLOAT8_DTYPE

from .test_float8 import FINITE, activations

#: Scales that take every branch: zero, subnormal, normal, just below and above the one-multiply
#: limit (2**7), beyond float16, the largest a cache holds, NaN, and negative (checked=True: the
#: arithmetic alone; a cache holds no negative scale, `float8.check_range`).
SCALES = np.array(
    [0, 2.0**-149, 2.0**-140, 3e-39, 1.17e-38, 1e-30, 1e-8, 0.37, 1, 1.5, 127.99, 128, 255.5, 300, 1e30, 7.6e35,
     np.nan, -2.5, -256, -1e30],
    np.float32,
)  # fmt: skip
ENGINES = ["numba", "numpy"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test once with the compiled kernels (skipped where numba is missing) and once with numpy."""
    if request.param == "numba":
        pytest.importorskip("numba")
        assert float8.kernels_in_use(), "numba imports but its kernels are not used"
        yield request.param
    else:
        with float8.numpy_only():
            yield request.param


def each_engine() -> Iterator[str]:
    """Within a hypothesis test (no function-scoped fixtures there): run the body with numba's
    kernels where they are in use, then with numpy's code."""
    if float8.kernels_in_use():
        yield "numba"
    with float8.numpy_only():
        yield "numpy"


def reference(codes: np.ndarray[Any, Any], scales: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """ml_dtypes' value of each byte, times its vector's scale in float32, rounded to ``dtype``."""
    with np.errstate(all="ignore"):
        wide: np.ndarray[Any, Any] = codes.view(FLOAT8_DTYPE).astype(np.float32) * scales[..., None]
        if dtype == "float32":
            return wide
        if dtype == "float16":
            return wide.astype(np.float16)
    return bfloat16.float32_to_bf16(wide)


def assert_bits_equal(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    """The same bits, except that NaNs only need to be NaN where the reference is (their payload
    and sign follow the hardware's choice of NaN operand)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        bits = np.uint32 if want.dtype == np.float32 else np.uint16
        np.testing.assert_array_equal(got.view(bits)[~nan], want.view(bits)[~nan])
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", list(float8.OUT_DTYPES))
def test_every_byte_at_every_kind_of_scale(engine: str, dtype: str) -> None:
    codes = np.tile(np.arange(256, dtype=np.uint8), (len(SCALES), 1))
    want = reference(codes, SCALES, dtype)
    assert_bits_equal(float8.dequantize(codes, SCALES, dtype, checked=True), want)
    rows = np.array([5, 0, 17, 17, 9, 3], np.int64)
    out = np.empty((len(rows), 256), float8.OUT_DTYPES[dtype])
    float8.take_dequantize(codes, SCALES, rows, out, dtype, checked=True)
    assert_bits_equal(out, want[rows])
    each = np.broadcast_to(SCALES[:, None], codes.shape)  # a view: one scale per vector
    assert_bits_equal(float8.dequantize_elementwise(codes, each, dtype, checked=True), want)
    assert_bits_equal(float8.dequantize_elementwise(codes, each.copy(), dtype, checked=True), want)


@given(
    codes=hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=40)),
    scales=st.data(),
    dtype=st.sampled_from(list(float8.OUT_DTYPES)),
)
def test_dequantize_matches_ml_dtypes(codes: np.ndarray[Any, Any], scales: st.DataObject, dtype: str) -> None:
    """Random bytes (NaN codes included) and float32 scales of every magnitude, any shape."""
    s = scales.draw(
        hnp.arrays(
            np.float32,
            codes.shape[:-1],
            elements=st.floats(width=32, allow_infinity=False) | st.sampled_from(SCALES.tolist()),
        )
    )
    want = reference(codes, s, dtype)
    for _ in each_engine():
        assert_bits_equal(float8.dequantize(codes, s, dtype, checked=True), want)


@given(
    window=hnp.arrays(np.uint8, st.tuples(st.integers(1, 30), st.integers(1, 70))),
    data=st.data(),
    dtype=st.sampled_from(list(float8.OUT_DTYPES)),
)
def test_take_dequantize_is_dequantize_of_the_gathered_rows(
    window: np.ndarray[Any, Any], data: st.DataObject, dtype: str
) -> None:
    """Rows of any shape (a batch of stacked layers is ``(n, L)``), clipped into the window as
    ``numpy.take(mode="clip")``, dequantized as `dequantize` would the gathered vectors."""
    scales = data.draw(hnp.arrays(np.float32, len(window), elements=st.floats(0, 100, width=32)))
    shape = hnp.array_shapes(min_dims=1, max_dims=2, max_side=12)
    rows = data.draw(hnp.arrays(np.int64, shape, elements=st.integers(-3, len(window) + 3)))
    want = reference(np.take(window, rows, axis=0, mode="clip"), np.take(scales, rows, mode="clip"), dtype)
    for _ in each_engine():
        out = np.empty((*rows.shape, window.shape[1]), float8.OUT_DTYPES[dtype])
        float8.take_dequantize(window, scales, rows, out, dtype)
        assert_bits_equal(out, want)


def test_take_dequantize_refuses_float16_overflow_and_bad_output(engine: str) -> None:
    window = np.full((3, 4), 0x7E, np.uint8)  # 448
    scales = np.array([1.0, 200.0, 1.0], np.float32)  # 448 * 200 is beyond float16
    out = np.empty((2, 4), np.float16)
    float8.take_dequantize(window, scales, np.array([0, 2]), out, "float16")
    assert (out == 448).all()
    with pytest.raises(ss.DtypeRangeError, match="do not fit float16"):
        float8.take_dequantize(window, scales, np.array([0, 1]), out, "float16")
    with pytest.raises(ValueError, match="out: expected a C-contiguous"):
        float8.take_dequantize(window, scales, np.array([0, 1]), np.empty((2, 4), np.float32), "float16")


def test_a_thread_that_flushes_subnormals_gets_the_same_values(engine: str) -> None:
    """With subnormal inputs read as zero (x86's DAZ: torch.set_flush_denormal), moving a byte's
    bits into a float32 would lose E4M3's subnormals; such a thread decodes with a table."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (3, 1))
    scales = np.array([1.0, 0.37, 100.0], np.float32)  # products stay normal: the same in any mode
    want = {dtype: reference(codes, scales, dtype) for dtype in float8.OUT_DTYPES}
    got: dict[str, Any] = {}

    def flushed() -> None:
        if not torch.set_flush_denormal(True):
            return
        try:
            assert not _float8_passes.subnormals_kept()
            for dtype in float8.OUT_DTYPES:
                got[dtype] = float8.dequantize(codes, scales, dtype)
        finally:
            torch.set_flush_denormal(False)

    thread = threading.Thread(target=flushed)
    thread.start()
    thread.join()
    if not got:
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")
    for dtype in float8.OUT_DTYPES:
        assert_bits_equal(got[dtype], want[dtype])


def test_kernels_are_checked_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels that disagree with numpy are not used (with a warning), nor are they with
    SAEV_SHARDS_NUMBA=0."""
    pytest.importorskip("numba")
    monkeypatch.setattr(float8, "_KERNELS", [])
    monkeypatch.setattr(float8, "_check_kernels", lambda kernels: "its dequantize to float16 differs from numpy's")
    with pytest.warns(UserWarning, match="numba's kernels are not used .*differs"):
        assert not float8.kernels_in_use()
    monkeypatch.setattr(float8, "_KERNELS", [])
    monkeypatch.setenv("SAEV_SHARDS_NUMBA", "0")
    assert not float8.kernels_in_use()
    codes = np.arange(256, dtype=np.uint8).reshape(4, 64)
    scales = np.ones(4, np.float32)
    assert_bits_equal(float8.dequantize(codes, scales, "float32"), reference(codes, scales, "float32"))


@given(activations(), st.sampled_from(["float32", "float16", "float64"]))
def test_the_three_quantizers_give_the_same_bytes(x: np.ndarray[Any, Any], dtype: str) -> None:
    """numba's kernel (what `quantize` runs with the `fast` extra), numpy with torch's E4M3
    cast (with torch alone) and with ml_dtypes' (`quantize_numpy`): the same bytes and scales,
    for float32, float16 and float64 input (each cast to float32 first, as the rule says)."""
    with np.errstate(over="ignore"):  # float16: inf where x is too large (stored as NaN vectors)
        source = x.astype(dtype)
    want_q, want_s = float8.quantize_numpy(source)
    for _ in each_engine():
        q, s = float8.quantize(torch.from_numpy(source) if dtype != "float64" else source)
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_array_equal(s, want_s)  # NaN where NaN


def test_the_compiled_quantizer_rounds_every_float32_between_e4m3_values() -> None:
    """Quotients across E4M3's whole range, with every rounding tie and both sides of each,
    through the kernel and through ml_dtypes' cast: the same bytes."""
    pytest.importorskip("numba")
    assert float8.kernels_in_use()
    finite = np.sort(FINITE[FINITE >= 0])
    middles = (finite[:-1] + finite[1:]) / 2  # ties: exact in float32
    y = np.concatenate([finite, middles, np.nextafter(middles, 0), np.nextafter(middles, 500), -middles])
    y = y.astype(np.float32)
    x = np.zeros((len(y) // 63 + 1, 64), np.float32)
    x[:, 0] = 448  # scale 1: each quotient is the value itself
    x[:, 1:].reshape(-1)[: len(y)] = y
    for factor in (1.0, 2.0**-100, 2.0**100):
        q, s = float8.quantize(x * np.float32(factor))
        want_q, want_s = float8.quantize_numpy(x * np.float32(factor))
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_array_equal(s, want_s)
