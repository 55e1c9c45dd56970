"""float8_e4m3 at the speed of the machine: quantizing and dequantizing by the rule of
`saev_shards.protocol.float8` (protocol.md 5), with the fastest engine this process has.

* Quantizing: the compiled kernel of `_float8_numba` (numba, the ``fast`` extra); else numpy
  passes with torch's E4M3 cast when torch is installed, else ml_dtypes' (`_float8_passes`);
  on a GPU, torch's ops on the tensor's own device (`quantize_tensor`).
* Dequantizing: one compiled pass per batch with numba, else numpy passes over chunks that
  stay in cache (`_float8_passes`), then rounding to float16 (torch's vectorised cast when
  torch is imported) or bfloat16. Both give the bits of ml_dtypes' values times the scale
  (tests compare them on every byte). On one core here, in GB/s of float8 input: numba
  ~10-16, numpy ~3 (float32 out), where the table of byte pairs this replaced ran at ~1.5
  and ml_dtypes' and torch's float8 casts at ~0.17. `take_dequantize` is a loader's gather.

The kernels are used once they have loaded and matched the numpy passes on every byte
(`kernels_in_use`); `numpy_only` turns them off for comparisons. The rule's names
(`FLOAT8_MAX`, `check_range`, ...) are re-exported here from `saev_shards.protocol.float8`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import SlowPathWarning
from ..optional import install_hint
from ..protocol.float8 import (
    BFLOAT16_MAX,
    FLOAT8_DTYPE,
    FLOAT8_MAX,
    FLOAT16_MAX,
    MAX_SCALE,
    NAN_BYTE,
    NAN_SCALE_BITS,
    OUT_DTYPES,
    SCALE_RULE,
    check_range,
    describe_scale,
    error_bound,
    odd_scales,
    scales_plain,
)
from . import _float8_passes as passes
from .bfloat16 import round_bfloat16

__all__ = [
    "BFLOAT16_MAX",
    "FLOAT8_DTYPE",
    "FLOAT8_MAX",
    "FLOAT16_MAX",
    "MAX_SCALE",
    "NAN_BYTE",
    "NAN_SCALE_BITS",
    "OUT_DTYPES",
    "SCALE_RULE",
    "check_range",
    "dequantize",
    "dequantize_elementwise",
    "describe_scale",
    "error_bound",
    "kernels_in_use",
    "numpy_only",
    "odd_scales",
    "quantize",
    "quantize_numpy",
    "quantize_tensor",
    "round_bfloat16",
    "scales_plain",
    "take_dequantize",
]


# -- quantizing ------------------------------------------------------------------------------


def quantize(x: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """Quantize float activations ``(..., D)`` (numpy array or torch tensor, any float dtype)
    by the rule of `saev_shards.protocol.float8`: ``(values, scales)``, E4M3 values of ``x``'s shape
    (`FLOAT8_DTYPE`) and float32 scales of shape ``x.shape[:-1]``, fresh C-contiguous arrays.

    A tensor on a GPU is quantized there (`quantize_tensor`), so only the bytes cross to the
    host. `TypeError` for non-floating input.
    """
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise TypeError(f"expected floating-point activations, found dtype {x.dtype}")
        if x.device.type != "cpu":
            q, s = quantize_tensor(x)
            return q.cpu().numpy().view(FLOAT8_DTYPE), s.cpu().numpy()
        x = x.detach()
        x = (x if x.dtype in (torch.float16, torch.float32, torch.float64) else x.to(torch.float32)).numpy()
    arr = np.asarray(x)
    _check_float(arr.dtype)
    return passes.quantize_all(arr, torch, _kernels())


def quantize_numpy(x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """`quantize` with numpy and ml_dtypes' cast only (what runs without torch and numba); the
    same bytes."""
    arr = np.asarray(x)
    _check_float(arr.dtype)
    return passes.quantize_all(arr, None, None)


def _check_float(dtype: np.dtype[Any]) -> None:
    if dtype.kind != "f":
        raise TypeError(f"expected floating-point activations, found dtype {dtype}")


def _torch() -> Any:
    """torch if it can be imported (on first use), else None."""
    torch = sys.modules.get("torch")
    if torch is None and not _NO_TORCH:
        try:
            import torch
        except ImportError:
            _NO_TORCH.append(True)
            return None
    return torch


#: Not empty once importing torch has failed in this process.
_NO_TORCH: list[bool] = []


def quantize_tensor(t: Any) -> tuple[Any, Any]:
    """`quantize` for a torch tensor, on its own device: ``(bytes, scales)``, the E4M3 bytes as
    a uint8 tensor of ``t``'s shape and the float32 scales ``t.shape[:-1]``, both on ``t``'s
    device (so that one byte per value crosses to the host: `saev_shards.dump`). On the CPU
    this is `quantize`; on a GPU the same rule in torch's ops on the whole tensor at once."""
    import torch

    t = t.detach()
    if t.device.type == "cpu":
        q_np, s_np = quantize(t)
        return torch.from_numpy(q_np.view(np.uint8)), torch.from_numpy(s_np)
    return passes.quantize_torch(t)


# -- the engine ------------------------------------------------------------------------------


#: ``[_float8_numba]`` once it has loaded and passed its check, ``[None]`` when it cannot be
#: used (numba not installed, failing here, or SAEV_SHARDS_NUMBA=0), empty before the first use.
_KERNELS: list[Any] = []
_KERNELS_LOCK = threading.Lock()


#: Not empty inside `numpy_only`.
_NUMPY_ONLY: list[bool] = []


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """Quantize and dequantize as without the ``fast`` extra inside this block, in every
    thread: numpy, with torch's E4M3 cast where torch is imported, else ml_dtypes'. For
    comparisons (benchmarks/float8.py) and tests; the results are the same bits."""
    _NUMPY_ONLY.append(True)
    try:
        yield
    finally:
        _NUMPY_ONLY.pop()


def _kernels() -> Any:
    """The compiled kernels (`_float8_numba`) when they can be used on this thread, else None."""
    if _NUMPY_ONLY or not passes.subnormals_kept():
        return None
    if not _KERNELS:
        with _KERNELS_LOCK:
            if not _KERNELS:
                _KERNELS.append(_load_kernels())
    return _KERNELS[0]


def kernels_in_use() -> bool:
    """True when `dequantize` runs numba's compiled kernels here (the ``fast`` extra), False
    when it runs numpy alone."""
    return _kernels() is not None


#: Why numba could not be imported (the ``fast`` extra missing, or a numba that does not
#: import beside this numpy), once `_load_kernels` has tried; empty otherwise.
_NO_NUMBA: list[str] = []
#: Not empty once `SlowPathWarning` has been issued in this process.
_SLOW_WARNED: list[bool] = []


def _load_kernels() -> Any:
    if os.environ.get("SAEV_SHARDS_NUMBA", "1") == "0":
        return None
    try:
        from . import _float8_numba
    except ImportError as err:
        _NO_NUMBA.append(str(err))
        return None
    try:
        mismatch = _check_kernels(_float8_numba)
    except Exception as err:  # numba installed but unable to compile here: numpy does the work
        mismatch = f"{type(err).__name__}: {err}"
    if mismatch:
        warnings.warn(f"float8: numba's kernels are not used ({mismatch}); dequantizing with numpy", stacklevel=3)
        return None
    return _float8_numba


def _warn_numpy_dequantize() -> None:
    """Say once per process that float8_e4m3 is dequantized with numpy because numba cannot be
    imported (not when numpy was asked for: `numpy_only`, ``SAEV_SHARDS_NUMBA=0``), with the
    pip command that installs the ``fast`` extra."""
    if _SLOW_WARNED or _NUMPY_ONLY or not _NO_NUMBA:
        return
    _SLOW_WARNED.append(True)
    warnings.warn(
        "float8_e4m3 values are dequantized with numpy, several times slower than with numba's compiled "
        f"kernels (the `fast` extra; numba: {_NO_NUMBA[0]}), so a float8 cache may read slower than a "
        f"float16 one; install it with: {install_hint('fast')}",
        SlowPathWarning,
        stacklevel=4,
    )


def _check_kernels(kernels: Any) -> str:
    """Every byte times scales across float32's range (subnormal, needing two multiplies, NaN,
    negative) through each dequantizing kernel against the numpy code, and vectors through the
    quantizing one against ml_dtypes' cast: what differs, or ""."""
    scales = np.array(
        [0, 1, 2.0**-140, 3e-39, 1.5e-30, 0.37, 127.99, 128, 300, 1e30, 7e35, np.nan, -2.5, -256], np.float32
    )
    codes = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))
    for dtype, want in OUT_DTYPES.items():
        expected, got = np.empty(codes.shape, want), np.empty(codes.shape, want)
        passes.dequantize_rows(codes, scales, expected, dtype)
        kernels.DEQUANTIZE[dtype](codes, scales, _bits(got))
        nan_equal = dtype != "bfloat16"  # bfloat16's NaN is one pattern; float16 and float32 NaNs compare as equal
        if not np.array_equal(got, expected, equal_nan=nan_equal):
            return f"its dequantizing to {dtype} differs from numpy's"
    # Quantizing: every finite E4M3 value (exact), values between them (rounding, ties), a
    # vector needing the clamp (subnormal scale), zeros, NaN and inf.
    finite = passes.byte_values()[(np.arange(256) & 0x7F) != 0x7F]
    between = np.linspace(-470, 470, 9409, dtype=np.float32)
    x = np.zeros((12, 1024), np.float32)
    x[0, : len(finite)] = finite
    x[1:10] = np.clip(between[: 9 * 1024].reshape(9, 1024), -448, 448)
    x[10] = np.linspace(-1, 1, 1024, dtype=np.float32) * np.float32(3e-40)
    x[11, 7], x[1, 3] = np.inf, np.nan
    x[:10] *= np.float32(2.0**-9)
    q, s = np.empty(x.shape, np.uint8), np.empty(len(x), np.float32)
    kernels.quantize_float32(x, q, s)
    want_q, want_s = quantize_numpy(x)
    if not (np.array_equal(q, want_q.view(np.uint8)) and np.array_equal(s, want_s, equal_nan=True)):
        return "its quantizing differs from ml_dtypes'"
    return ""


def _bits(out: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """float16 output as its uint16 bits, which the kernels write (numba has no float16 arrays)."""
    return out.view(np.uint16) if out.dtype == np.float16 else out


# -- dequantizing ----------------------------------------------------------------------------


def _out_dtype(dtype: str) -> np.dtype[Any]:
    want = OUT_DTYPES.get(dtype)
    if want is None:
        raise ValueError(f"dtype: expected one of {list(OUT_DTYPES)}, found {dtype!r}")
    return want


def dequantize(
    values: npt.NDArray[Any],
    scales: npt.NDArray[Any],
    dtype: str = "float16",
    out: npt.NDArray[Any] | None = None,
    *,
    checked: bool = False,
) -> npt.NDArray[Any]:
    """E4M3 ``values`` ``(..., D)`` (`FLOAT8_DTYPE` or their uint8 bytes) with their float32
    ``scales`` ``(...)``, dequantized into ``dtype`` (one of `OUT_DTYPES`; bfloat16 as its
    uint16 bits): ``RN32(float32(q) * s)``, rounded to ``dtype`` (nearest, ties to even).

    Into ``out`` (a C-contiguous array of that dtype and shape) when given. `DtypeRangeError`
    when float16 cannot hold the values (`check_range`; ``checked``: the caller has checked).
    One compiled pass with numba (the ``fast`` extra), else numpy (`kernels_in_use`).
    """
    want = _out_dtype(dtype)
    shape = values.shape
    if scales.shape != shape[:-1]:
        raise ValueError(f"scales: expected shape {shape[:-1]} for values of shape {shape}, found {scales.shape}")
    if out is None:
        out = np.empty(shape, want)
    elif out.shape != shape or out.dtype != want or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous {want} array of shape {shape}, found {out.dtype} {out.shape}")
    if not checked:
        check_range(np.asarray(scales), dtype)
    if out.size == 0:
        return out
    d_model = shape[-1] if shape else 1
    codes = np.ascontiguousarray(values).view(np.uint8).reshape(-1, d_model)
    s = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    flat = out.reshape(-1, d_model)
    kernels = _kernels()
    if kernels is not None:
        kernels.DEQUANTIZE[dtype](codes, s, _bits(flat))
    else:
        _warn_numpy_dequantize()
        passes.dequantize_rows(codes, s, flat, dtype)
    return out


def take_dequantize(
    values: npt.NDArray[Any],
    scales: npt.NDArray[np.float32],
    rows: npt.NDArray[np.integer[Any]],
    out: npt.NDArray[Any],
    dtype: str,
    *,
    checked: bool = False,
) -> None:
    """The vectors ``rows`` (integers, any shape; clipped to ``[0, W)`` as ``numpy.take``'s
    ``mode="clip"``) of ``values`` ``(W, D)`` (E4M3 bytes) with their ``scales`` ``(W,)``,
    dequantized into ``out`` (C-contiguous, ``(*rows.shape, D)``, of ``dtype``): a loader's
    gather. `DtypeRangeError` as `dequantize`.

    A chunk of rows at a time (`_TAKE_BYTES`) is gathered by ``numpy.take`` into a scratch
    array that stays in cache, then dequantized from there into ``out``: numpy's row copies
    keep many random rows in flight, so this is ~20% faster than one kernel that reads each
    row where it lies (measured with numba, benchmarks/float8.py's kernel table).
    """
    want = _out_dtype(dtype)
    d_model = values.shape[-1]
    shape = (*rows.shape, d_model)
    if out.shape != shape or out.dtype != want or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous {want} array of shape {shape}, found {out.dtype} {out.shape}")
    flat_rows = rows.reshape(-1)
    picked_scales = np.take(np.asarray(scales, dtype=np.float32), flat_rows, mode="clip")
    if not checked:
        check_range(picked_scales, dtype)
    if out.size == 0:
        return
    codes = values.view(np.uint8).reshape(-1, d_model)
    flat = out.reshape(-1, d_model)
    kernels = _kernels()
    if kernels is None:
        _warn_numpy_dequantize()
        passes.dequantize_rows(codes, picked_scales, flat, dtype, flat_rows)
        return
    step = max(1, _TAKE_BYTES // d_model)
    picked = _scratch((min(step, len(flat_rows)), d_model))
    for a in range(0, len(flat_rows), step):
        b = min(a + step, len(flat_rows))
        np.take(codes, flat_rows[a:b], axis=0, out=picked[: b - a], mode="clip")
        kernels.DEQUANTIZE[dtype](picked[: b - a], picked_scales[a:b], _bits(flat[a:b]))


#: Bytes of rows gathered at a time by `take_dequantize` before they are dequantized: in L2.
_TAKE_BYTES = 1 << 19
_LOCAL = threading.local()


def _scratch(shape: tuple[int, int]) -> npt.NDArray[np.uint8]:
    """This thread's uint8 scratch array of ``shape`` (reused: a fresh one costs page faults)."""
    arr: npt.NDArray[np.uint8] | None = getattr(_LOCAL, "scratch", None)
    size = shape[0] * shape[1]
    if arr is None or arr.size < size:
        arr = np.empty(size, np.uint8)
        _LOCAL.scratch = arr
    return arr[:size].reshape(shape)


def dequantize_elementwise(
    values: npt.NDArray[Any], scales: npt.NDArray[Any], dtype: str, *, checked: bool = False
) -> npt.NDArray[Any]:
    """`dequantize` where ``scales`` already has ``values``' shape (each value's vector's scale,
    as indexing a cache gives them): the same arithmetic, for arrays of any shape. Scales
    broadcast along the last axis (a stride of 0: one per vector) go to `dequantize`."""
    want = _out_dtype(dtype)
    s = np.asarray(scales, np.float32)
    if s.ndim and s.shape == np.shape(values) and s.shape[-1] and s.strides[-1] == 0:
        return dequantize(np.asarray(values), s[..., 0], dtype, checked=checked)
    if not checked:
        check_range(s, dtype)
    codes = np.ascontiguousarray(values).view(np.uint8)
    wide = np.empty(codes.shape, np.float32)
    with np.errstate(all="ignore"):
        if passes.decode(codes, wide):
            np.multiply(wide, passes.TWO_120, out=wide)
        np.multiply(wide, s, out=wide)
        passes.nan_codes(codes, wide)
        if dtype == "float32":
            return wide
        out = np.empty(wide.shape, want)
        if dtype == "float16":
            passes.narrow(wide, out)
        else:
            round_bfloat16(wide, out)
    return out
