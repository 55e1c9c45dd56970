"""`saev_shards.codecs.gather`: the compiled float16 and bfloat16 -> float32 gathers give the bits
of the loaders' numpy gather and cast for every bit pattern; the kernels are checked before use,
can be turned off, and load in the background without making a caller wait (the window indexes
are tested against numpy through the loaders: tests/unit/loaders/test_compiled_paths.py)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from saev_shards.codecs import gather
from saev_shards.loaders.outputs import cast_into

pytestmark = pytest.mark.skipif(not gather.kernels_in_use(), reason="numba (the `fast` extra) is not installed")


@pytest.mark.parametrize("stored", gather.WIDENS)
def test_take_widen_gives_the_casts_bits(stored: str) -> None:
    """Every bit pattern (zeros, subnormals, normals, inf, NaN of both signs), rows out of range
    clipped as ``numpy.take(mode="clip")``: the bits of the numpy gather and the loaders' cast."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 128)
    values = bits.view(np.float16) if stored == "float16" else bits
    rows = np.concatenate([np.arange(len(bits)), [-3, len(bits) + 9, 7]]).astype(np.int64)
    got = np.full((len(rows), 128), np.nan, np.float32)
    assert gather.take_widen(values, rows, got, stored)
    want = np.empty_like(got)
    cast_into(np.take(values, rows, axis=0, mode="clip"), stored, "float32", want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_take_widen_stacked_rows_and_numpy_only() -> None:
    values = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float16)
    rows = np.random.default_rng(1).integers(0, 50, (6, 3))
    out = np.empty((6, 3, 8), np.float32)
    assert gather.take_widen(values, rows, out, "float16")
    assert np.array_equal(out, values[rows].astype(np.float32))
    with gather.numpy_only():
        assert not gather.kernels_in_use()
        assert not gather.take_widen(values, rows, out, "float16")
    assert not gather.take_widen(values.astype(np.float32), rows, out, "float32")


def test_kernels_are_checked_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels that disagree with numpy are not used (with a warning), nor are they with
    SAEV_SHARDS_NUMBA=0: the loaders then gather and index with numpy."""
    monkeypatch.setattr(gather, "_KERNELS", [])
    monkeypatch.setattr(gather, "_BACKGROUND", [])
    monkeypatch.setattr(gather, "_check_kernels", lambda kernels: "its widening of float16 differs from numpy's")
    with pytest.warns(UserWarning, match="numba's kernels are not used .*differs"):
        assert not gather.kernels_in_use()
    out = np.empty((2, 4), np.float32)
    assert not gather.take_widen(np.ones((3, 4), np.float16), np.array([0, 2]), out, "float16")
    monkeypatch.setattr(gather, "_KERNELS", [])
    monkeypatch.setenv("SAEV_SHARDS_NUMBA", "0")
    assert not gather.kernels_in_use()


def test_kernels_load_in_background(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the kernels have loaded, the loaders' calls do not wait for them (numpy does the work);
    a loader starts loading them on a thread of its own, once per process."""
    monkeypatch.setattr(gather, "_KERNELS", [])
    monkeypatch.setattr(gather, "_BACKGROUND", [])
    gate = threading.Event()
    real_load = gather._load_kernels

    def slow_load() -> Any:
        assert gate.wait(timeout=20)
        return real_load()

    monkeypatch.setattr(gather, "_load_kernels", slow_load)
    out = np.empty((2, 4), np.float32)
    assert not gather.take_widen(np.ones((3, 4), np.float16), np.array([0, 2]), out, "float16")  # not waiting
    assert not gather.kernels_ready()
    assert len(gather._BACKGROUND) == 1
    gate.set()
    gather._BACKGROUND[0].join(timeout=20)
    assert gather.kernels_ready()
    assert gather.take_widen(np.ones((3, 4), np.float16), np.array([0, 2]), out, "float16")
    assert np.array_equal(out, np.ones((2, 4), np.float32))
