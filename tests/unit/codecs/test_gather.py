"""`saev_shards.codecs.gather`: the compiled float16 and bfloat16 -> float32 gathers give the bits
of the loaders' numpy gather and cast for every bit pattern; the kernels are checked before use,
can be turned off, and load in the background without making a caller wait; the window index kernel
gives numpy's columns from any first unit, in order or permuted (and through the loaders:
tests/unit/loaders/test_compiled_paths.py)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=200, deadline=None)
@given(
    n_ex=st.integers(1, 6),
    n_slots=st.integers(1, 3),
    tokens=st.integers(1, 5),
    data=st.data(),
    permuted=st.booleans(),
    stacked=st.booleans(),
    labels=st.booleans(),
)
def test_window_index_from_any_first_unit(
    n_ex: int, n_slots: int, tokens: int, data: Any, permuted: bool, stacked: bool, labels: bool
) -> None:
    """Units ``lo .. lo + n`` of a window (example, slot, token order; a rank's share starts
    anywhere, even inside an example's slot), in order (counted up from the first unit) or
    permuted (each unit's number divided out): the columns numpy's arithmetic gives."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    chosen = np.sort(rng.choice(tokens + 2, tokens, replace=False)).astype(np.int64)
    slots = rng.permutation(n_slots + 1)[:n_slots].astype(np.int32)
    per_slot = 1 if stacked else n_slots
    total = n_ex * per_slot * tokens
    lo = data.draw(st.integers(0, total - 1))
    n = data.draw(st.integers(0, total - lo))
    order = rng.permutation(n).astype(np.int64) if permuted else None
    ex_vector = rng.integers(0, 10_000, n_ex).astype(np.int64)
    slot_vector = np.arange(n_slots + 1, dtype=np.int64) * 100
    stack_offsets = slot_vector[slots] if stacked else None
    examples = rng.integers(0, 1000, n_ex).astype(np.int64)
    slot_layer = rng.integers(0, 24, n_slots + 1).astype(np.int64)
    label_values = rng.integers(0, 5, (n_ex, tokens + 2)).astype(np.uint8) if labels else None
    rows = gather.Rows(ex_vector, slot_vector, stack_offsets, examples, slot_layer, label_values, tokens + 2)
    got = gather.window_index(order, lo, n, per_slot * tokens, slots, chosen, rows)
    assert got is not None
    unit = lo + (np.arange(n, dtype=np.int64) if order is None else order)
    ex, rest = np.divmod(unit, per_slot * tokens)
    s, t = np.divmod(rest, tokens)
    tok = chosen[t]
    if stacked:
        assert stack_offsets is not None
        want_flat = ex_vector[ex][:, None] + tok[:, None] + stack_offsets[None, :]
    else:
        want_flat = ex_vector[ex] + tok + slot_vector[slots[s]]
    flat, ex_col, tok_col, layer_col, label_col = got
    assert np.array_equal(flat, want_flat)
    assert np.array_equal(ex_col, examples[ex])
    assert np.array_equal(tok_col, tok)
    if stacked:
        assert layer_col is None
    else:
        assert layer_col is not None and np.array_equal(layer_col, slot_layer[slots[s]])
    if label_values is None:
        assert label_col is None
    else:
        assert label_col is not None and np.array_equal(label_col, label_values[ex, tok])
