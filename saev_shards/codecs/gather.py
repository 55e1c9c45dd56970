"""A loader's compiled gathers and window indexes (`_gather_numba`, numba: the ``fast`` extra),
with numpy doing the same work where numba is missing: the same values either way.

* `take_widen`: rows of float16 or bfloat16 values gathered and widened to float32 in one pass
  (a float8_e4m3 cache's gather is `float8.take_dequantize`'s, rows of the stored dtype are
  ``numpy.take``'s: one pass already).
* `window_index` and `window_index_listed`: the columns of a window's index (`loaders.plan`)
  from its units' numbers, or from its listed units, in one pass.

The kernels are used once they have loaded and matched the numpy code on a test input
(`kernels_in_use`); until then (a new process takes 1-3 s to import numba and load them: a
loader starts that on a thread of its own, `load_in_background`) the same work is numpy's.
`numpy_only` turns them off, in every thread, for comparisons and tests.
``SAEV_SHARDS_NUMBA=0`` turns them off for the process, as it does float8_e4m3's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._float8_passes import subnormals_kept

#: Stored dtypes `take_widen` widens to float32 in one pass.
WIDENS = ("float16", "bfloat16")

#: ``[_gather_numba]`` once it has loaded and passed its check, ``[None]`` when it cannot be
#: used, empty before the first use.
_KERNELS: list[Any] = []
_KERNELS_LOCK = threading.Lock()
#: Not empty inside `numpy_only`.
_NUMPY_ONLY: list[bool] = []


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """Gather and index with numpy alone inside this block, in every thread, as without the
    ``fast`` extra (for comparisons and tests): the same values."""
    _NUMPY_ONLY.append(True)
    try:
        yield
    finally:
        _NUMPY_ONLY.pop()


def _kernels(wait: bool = True) -> Any:
    """The kernels, or None where they cannot be used. ``wait=False``: None until they have
    loaded, loading them on a thread of their own meanwhile (`load_in_background`)."""
    if _NUMPY_ONLY:
        return None
    if not _KERNELS:
        if not wait:
            load_in_background()
            return None
        _load()
    return _KERNELS[0]


def _load() -> None:
    with _KERNELS_LOCK:
        if not _KERNELS:
            _KERNELS.append(_load_kernels())


def kernels_in_use() -> bool:
    """True when the loaders' gathers and window indexes run numba's compiled kernels here (loading
    them first if need be)."""
    return _kernels() is not None


def kernels_ready() -> bool:
    """Whether the kernels have loaded (and can be used), without waiting for them."""
    return _kernels(wait=False) is not None


_BACKGROUND: list[threading.Thread] = []


def load_in_background() -> None:
    """Start loading the kernels on a daemon thread, once per process. Importing numba and loading
    its compiled code from the cache take 1-3 s of a new process; a loader starts this when it is
    made and uses numpy until the kernels are there (the same batches), so its first batch never
    waits for them."""
    if _KERNELS or _BACKGROUND:
        return
    with _KERNELS_LOCK:
        if _KERNELS or _BACKGROUND:
            return
        thread = threading.Thread(target=_load, name="saev-gather-kernels", daemon=True)
        _BACKGROUND.append(thread)
    thread.start()


def _load_kernels() -> Any:
    if os.environ.get("SAEV_SHARDS_NUMBA", "1") == "0":
        return None
    try:
        from . import _gather_numba
    except ImportError:  # the `fast` extra missing: numpy does the work (float8 says so once)
        return None
    try:
        mismatch = _check_kernels(_gather_numba)
    except Exception as err:  # numba installed but unable to compile here
        mismatch = f"{type(err).__name__}: {err}"
    if mismatch:
        warnings.warn(f"loader gathers: numba's kernels are not used ({mismatch}); using numpy", stacklevel=3)
        return None
    return _gather_numba


def _check_kernels(kernels: Any) -> str:
    """Every float16 and bfloat16 bit pattern through the widening kernels against numpy's
    widening, and a small window's index through the index kernels against numpy: what
    differs, or ""."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 256)
    rows = np.array([3, 0, 255, -4, 1000, 17], dtype=np.int64)
    for stored in WIDENS:
        got = np.empty((len(rows), 256), np.float32)
        _TAKE_WIDEN_KERNELS[stored](kernels)(bits, rows, got.view(np.uint32))
        want = _widen_numpy(np.take(bits, rows, axis=0, mode="clip"), stored)
        same = got.view(np.uint32) == want.view(np.uint32)
        # NaN payloads: the kernel makes a float16 NaN quiet (as the hardware conversions do).
        same |= np.isnan(got) & np.isnan(want)
        if not same.all():
            return f"its widening of {stored} differs from numpy's"
    return ""


_TAKE_WIDEN_KERNELS = {
    "float16": lambda k: k.take_widen_float16,
    "bfloat16": lambda k: k.take_widen_bfloat16,
}


def _widen_numpy(raw: npt.NDArray[Any], stored: str) -> npt.NDArray[np.float32]:
    if stored == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float16).astype(np.float32)


def take_widen(
    values: npt.NDArray[Any], rows: npt.NDArray[np.integer[Any]], out: npt.NDArray[np.float32], stored: str
) -> bool:
    """Rows ``rows`` (any shape; clipped to ``[0, W)`` as ``numpy.take``'s ``mode="clip"``) of
    ``values`` ``(W, D)`` (float16 or bfloat16 bits: `WIDENS`), widened into ``out`` (C-contiguous
    float32, ``(*rows.shape, D)``) in one compiled pass. False, with nothing written, where the
    kernels are not in use (the caller gathers and casts)."""
    kernels = _kernels(wait=False)
    # float16 subnormals read as zero on a thread that flushes them: numpy's cast then.
    if kernels is None or stored not in WIDENS or not subnormals_kept():
        return False
    d_model = values.shape[-1]
    src = values.view(np.uint16).reshape(-1, d_model)
    _TAKE_WIDEN_KERNELS[stored](kernels)(src, rows.reshape(-1), out.view(np.uint32).reshape(-1, d_model))
    return True


#: The columns of a window's index: ``(flat, examples, tokens, layers or None, labels or None)``.
Columns = tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64] | None,
    npt.NDArray[np.uint8] | None,
]

#: An empty array: "no order" (units in their listed order), "not stacked" and "no labels" to the kernels.
_NONE = np.empty(0, dtype=np.int64)
_NO_LABELS = np.empty(0, dtype=np.uint8)
#: No slots, and no listed units ``(example, slot, token)``: the index kernel's other mode.
_NO_SLOTS = np.empty(0, dtype=np.int32)
_NOT_LISTED = (_NONE, _NO_SLOTS, _NONE)


class Rows(NamedTuple):
    """Where a window's units are and what the batches say of them (`loaders.plan.index_window`)."""

    #: The first vector of each of the window's examples, in the array its gathers read.
    ex_vector: npt.NDArray[np.int64]
    #: The offset in vectors of each slot (a layer position of an example).
    slot_vector: npt.NDArray[np.int64]
    #: With stacked layers, the offsets of the stacked slots (each unit a row of them); else None.
    stacked: npt.NDArray[np.int64] | None
    #: The global index of each of the window's examples.
    examples: npt.NDArray[np.int64]
    #: The layer value of each slot.
    slot_layer: npt.NDArray[np.int64]
    #: ``(examples, T)`` labels.bin values of the window's examples, or None without labels.bin.
    labels: npt.NDArray[np.uint8] | None
    tokens_per_ex: int

    def kernel_args(self) -> tuple[Any, ...]:
        labels = _NO_LABELS if self.labels is None else self.labels.reshape(-1)
        stacked = _NONE if self.stacked is None else self.stacked
        return (self.ex_vector, self.slot_vector, stacked, self.examples, self.slot_layer, labels, self.tokens_per_ex)


def window_index(
    order: npt.NDArray[np.int64] | None,
    lo: int,
    n_units: int,
    per_ex: int,
    slots: npt.NDArray[Any],
    chosen: npt.NDArray[np.int64],
    rows: Rows,
) -> Columns | None:
    """The columns of the index of a window whose examples all hold the ``chosen`` tokens: batch
    unit ``u`` is unit number ``lo + order[u]`` (``lo + u`` without ``order``) in example, slot,
    token order, ``per_ex`` units per example (``slots``: the slot of each layer position). None
    where the kernels are not in use."""
    kernels = _kernels(wait=False)
    if kernels is None:
        return None
    outs = _outputs(n_units, rows)
    units = (np.int64(lo), np.int64(per_ex), slots, chosen)
    kernels.window_index(_NONE if order is None else order, units, _NOT_LISTED, rows.kernel_args(), outs)
    return _columns(outs, rows)


def window_index_listed(
    order: npt.NDArray[np.int64] | None,
    listed: tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[np.int64]],
    rows: Rows,
) -> Columns | None:
    """`window_index` from the listed units ``(example, slot, token)`` of a window (batch unit
    ``u`` is listed unit ``order[u]``, or ``u``). None where the kernels are not in use."""
    kernels = _kernels(wait=False)
    if kernels is None:
        return None
    outs = _outputs(len(listed[0]), rows)
    ex_c, slot_c, tok_c = listed
    units = (np.int64(0), np.int64(0), _NO_SLOTS, _NONE)
    listed_args = (
        ex_c.astype(np.int64, copy=False),
        slot_c.astype(np.int32, copy=False),
        tok_c.astype(np.int64, copy=False),
    )
    kernels.window_index(_NONE if order is None else order, units, listed_args, rows.kernel_args(), outs)
    return _columns(outs, rows)


def _outputs(n: int, rows: Rows) -> tuple[npt.NDArray[Any], ...]:
    width = 1 if rows.stacked is None else len(rows.stacked)
    return (
        np.empty((n, width), np.int64),
        np.empty(n, np.int64),
        np.empty(n, np.int64),
        np.empty(n if rows.stacked is None else 0, np.int64),
        np.empty(n if rows.labels is not None else 0, np.uint8),
    )


def _columns(outs: tuple[npt.NDArray[Any], ...], rows: Rows) -> Columns:
    flat, ex, tok, layer, label = outs
    stacked = rows.stacked is not None
    return (
        flat if stacked else flat[:, 0],
        ex,
        tok,
        None if stacked else layer,
        None if rows.labels is None else label,
    )
