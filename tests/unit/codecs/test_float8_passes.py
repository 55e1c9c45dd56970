"""codecs._float8_passes: the numpy and torch passes give the bytes and values of the rule
written out (`saev_shards.protocol.float8`), whatever the chunking, the threads or the rows taken."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.codecs import _float8_passes as passes
from saev_shards.protocol.float8 import reference_dequantize, reference_quantize

vectors = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
    elements=st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, 1e-40, np.nan]),
)


@given(vectors, st.booleans())
def test_quantize_all_gives_the_reference_bytes(x: np.ndarray[Any, Any], with_torch: bool) -> None:
    torch = pytest.importorskip("torch") if with_torch else None
    q, scales = passes.quantize_all(x, torch, None)
    want_q, want_scales = reference_quantize(x)
    np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))


def test_quantize_all_on_several_threads_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(passes, "CHUNK_VALUES", 64)  # 8 rows of 8 a chunk: 100 chunks, several threads
    monkeypatch.setattr(passes, "_QUANTIZE_THREADS", 3)
    x = np.random.default_rng(0).standard_normal((800, 8)).astype(np.float64)
    q, scales = passes.quantize_all(x, None, None)
    want_q, want_scales = reference_quantize(x)
    np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(scales, want_scales)


@given(vectors, st.sampled_from(["float32", "float16", "bfloat16"]), st.integers(1, 4), st.data())
def test_dequantize_rows_gives_the_reference_values(
    x: np.ndarray[Any, Any], dtype: str, chunk_rows: int, data: st.DataObject
) -> None:
    q, scales = reference_quantize(x)
    codes = q.view(np.uint8)
    take = np.array(data.draw(st.lists(st.integers(0, len(x) - 1), max_size=8)), np.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(passes, "CHUNK_VALUES", chunk_rows * x.shape[1])  # several chunks
        out = np.empty(codes.shape, np.dtype({"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype]))
        passes.dequantize_rows(codes, scales, out, dtype)
        taken = np.empty((len(take), codes.shape[1]), out.dtype)
        passes.dequantize_rows(codes, scales[take], taken, dtype, take)
    want = reference_dequantize(codes, scales, dtype)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(taken, want[take])


def test_every_byte_decodes_to_its_value() -> None:
    codes = np.arange(256, dtype=np.uint8)
    wide = np.empty(256, np.float32)
    biased = passes.decode(codes, wide)
    if biased:
        wide *= passes.TWO_120
    passes.nan_codes(codes, wide)
    values = passes.byte_values()
    np.testing.assert_array_equal(wide, values)  # NaN where ml_dtypes has NaN (0x7F, 0xFF)
    assert np.isnan(values[[0x7F, 0xFF]]).all() and np.signbit(wide[0xFF]) and not np.signbit(wide[0x7F])
    assert passes.subnormals_kept()  # numpy's own arithmetic keeps them


@given(st.integers(0, 1 << 20))
def test_rows_per_chunk_keeps_a_chunk_within_its_values(d_model: int) -> None:
    rows = passes.rows_per_chunk(d_model)
    assert rows >= 1
    assert rows * d_model <= passes.CHUNK_VALUES or rows == 1


@pytest.mark.parametrize("torch_imported", [False, True])
def test_narrow_rounds_to_float16_as_numpy(torch_imported: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch_imported:
        pytest.importorskip("torch")
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    wide = np.array([1.0, 1 + 2.0**-11, 65504.0, 70000.0, -1e-8, np.nan], np.float32)
    dest = np.empty(wide.shape, np.float16)
    passes.narrow(wide, dest)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(dest, wide.astype(np.float16))


@given(vectors)
def test_quantize_torch_gives_the_reference_bytes(x: np.ndarray[Any, Any]) -> None:
    torch = pytest.importorskip("torch")
    q, scales = passes.quantize_torch(torch.from_numpy(x.copy()))
    want_q, want_scales = reference_quantize(x)
    np.testing.assert_array_equal(q.numpy(), want_q.view(np.uint8))
    np.testing.assert_array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32))
