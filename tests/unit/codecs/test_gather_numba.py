"""codecs._gather_numba: the compiled gathers widen every float16 and bfloat16 bit pattern to
the float32 numpy gives (NaN made quiet), from the rows asked, clipped to the source."""

from __future__ import annotations

import numpy as np
import pytest

kernels = pytest.importorskip("saev_shards.codecs._gather_numba")  # the ``fast`` extra (numba)


def test_every_float16_and_bfloat16_pattern_widens_exactly() -> None:
    src = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    rows = np.array([255, 0, 7, 300, -4], np.int64)  # past either end: clipped
    want_rows = np.clip(rows, 0, 255)

    out = np.empty((len(rows), 256), np.uint32)
    kernels.take_widen_bfloat16(src, rows, out)
    np.testing.assert_array_equal(out, src[want_rows].astype(np.uint32) << 16)

    kernels.take_widen_float16(src, rows, out)
    want = src[want_rows].view(np.float16).astype(np.float32)
    got = out.view(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert (out[nan] & 0x00400000).all()  # every NaN quiet
