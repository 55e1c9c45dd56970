"""float8_e4m3 with one float32 scale per vector (protocol.md section 5): the scale rule,
quantizing and dequantizing.

The rule, for one vector ``x`` of ``D`` values taken as float32 (protocol.md 5 is normative;
``RN32`` rounds to the nearest float32, ties to even):

* ``m = max |x_i|`` and the scale ``s = RN32(m / 448)``;
* if ``s`` is 0 (``m`` is 0, or so small that the quotient underflows), every byte is 0x00
  and the scale is +0.0;
* if ``x`` holds inf or NaN (stored only with ``allow_nonfinite=True``), every byte is 0x7F
  (E4M3's NaN) and the scale NaN (0x7FC00000);
* otherwise ``q_i = E4M3(clamp(RN32(x_i / s), -448, 448))``, rounded to nearest, ties to
  even. The clamp only ever acts when ``s`` is subnormal (``m`` below about 5.3e-36), where
  rounding the scale can carry ``x_i / s`` past 448.

Dequantized, a value is ``RN32(float32(q_i) * s)``, then rounded (to nearest, ties to even)
to the dtype asked for. Its error is at most ``|x_i| / 16`` (half a unit in the last place of
E4M3's 3 mantissa bits) or, below E4M3's normal range, ``s / 1024`` (half the spacing of its
subnormals, ``2**-10`` after scaling), plus the float32 roundings of the scale and the
product (`error_bound`).

Quantizing uses torch's ``float8_e4m3fn`` cast when torch is installed: vectorised, about 8x
ml_dtypes' ufunc cast on this machine (4.7 against 0.58 GB/s of float32 input on one core).
Without torch it uses ml_dtypes'. Both round the same way, bit for bit (a hypothesis test
compares them). Dequantizing needs numpy alone: a table of every pair of E4M3 bytes (ml_dtypes'
values) looked up in chunks that stay in cache, ~1.5 GB/s of float8 input on one core here,
where ml_dtypes' cast and torch's run at ~0.17.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .errors import DtypeRangeError

#: The numpy dtype of stored E4M3 values (ml_dtypes' float8_e4m3fn: no infinities, largest 448).
FLOAT8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
#: Largest finite E4M3 value: the largest |value| of every vector is stored as it.
FLOAT8_MAX = 448.0
#: The bytes of a vector that held inf or NaN (E4M3's positive NaN).
NAN_BYTE = 0x7F
#: Smallest normal float32: below it a scale is subnormal and the clamp of the rule can act.
_MIN_NORMAL = np.float32(2.0**-126)
#: float16's largest finite value, and the smallest float32 that rounds to float16 infinity.
FLOAT16_MAX = 65504.0
_FLOAT16_OVERFLOW = np.float32(65520.0)
#: Values per step of the chunked loops: their float32 scratch stays in L2 (256 KiB).
_CHUNK_VALUES = 1 << 16
#: Dtypes values are dequantized into here (`saev_shards.dtypes.convert` rounds float32 on to bfloat16).
OUT_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}


# -- quantizing ------------------------------------------------------------------------------


def quantize(x: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """Quantize float activations ``(..., D)`` (numpy array or torch tensor, any float dtype)
    by the rule of the module docstring: ``(values, scales)``, E4M3 values of ``x``'s shape
    (`FLOAT8_DTYPE`) and float32 scales of shape ``x.shape[:-1]``, fresh C-contiguous arrays.

    A torch tensor is quantized on its own device, so only the bytes cross to the host.
    `TypeError` for non-floating input.
    """
    torch = _torch()
    if torch is not None:
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point():
                raise TypeError(f"expected floating-point activations, found dtype {x.dtype}")
            return _quantize_torch(x)
        arr = np.asarray(x)
        _check_float(arr.dtype)
        if arr.dtype.str not in ("<f2", "<f4", "<f8"):
            arr = arr.astype(np.float32)  # float128, big-endian: torch has no such dtype
        with warnings.catch_warnings():  # a read-only array (a memmap slice) is only read here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return _quantize_torch(torch.from_numpy(np.ascontiguousarray(arr)))
    arr = np.asarray(x)
    _check_float(arr.dtype)
    return _quantize_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def quantize_numpy(x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """`quantize` with ml_dtypes only (what runs without torch); the same bytes."""
    _check_float(x.dtype)
    return _quantize_numpy(np.ascontiguousarray(x, dtype=np.float32))


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


def _rows_per_chunk(d_model: int) -> int:
    return max(1, _CHUNK_VALUES // max(1, d_model))


def _quantize_numpy(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    shape = x.shape
    d_model = shape[-1] if shape else 1
    flat = x.reshape(-1, d_model)
    n = flat.shape[0]
    q = np.empty((n, d_model), FLOAT8_DTYPE)
    scales = np.empty(n, np.float32)
    rows = _rows_per_chunk(d_model)
    with np.errstate(all="ignore"):  # NaN rows and subnormal scales are dealt with below
        for a in range(0, n, rows):
            chunk = flat[a : a + rows]
            s = np.abs(chunk).max(axis=1) / np.float32(FLOAT8_MAX) if d_model else np.zeros(len(chunk), np.float32)
            if bool((s >= _MIN_NORMAL).all()) and bool(np.isfinite(s).all()):
                q[a : a + rows] = (chunk / s[:, None]).astype(FLOAT8_DTYPE)
            else:
                ok = (s > 0) & np.isfinite(s)
                y = chunk / np.where(ok, s, np.float32(1))[:, None]
                np.clip(y, -FLOAT8_MAX, FLOAT8_MAX, out=y)
                piece = y.astype(FLOAT8_DTYPE).view(np.uint8)
                piece[s == 0] = 0
                bad = ~np.isfinite(s)
                piece[bad] = NAN_BYTE
                s[bad] = np.float32(np.nan)
                q[a : a + rows] = piece.view(FLOAT8_DTYPE)
            scales[a : a + rows] = s
    return q.reshape(shape), scales.reshape(shape[:-1])


def _quantize_torch(t: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    import torch

    t = t.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)  # on its own device: float32 is what the rule divides
    t = t.contiguous()
    shape = tuple(t.shape)
    d_model = shape[-1] if shape else 1
    flat = t.reshape(-1, d_model)
    n = flat.shape[0]
    q = torch.empty((n, d_model), dtype=torch.uint8, device=t.device)
    scales = torch.empty(n, dtype=torch.float32, device=t.device)
    # On the CPU in chunks that stay in cache (4x faster than whole arrays here); on a GPU at once.
    rows = _rows_per_chunk(d_model) if t.device.type == "cpu" else max(1, n)
    for a in range(0, n, rows):
        chunk = flat[a : a + rows]
        s = torch.amax(chunk.abs(), dim=1) / FLOAT8_MAX if d_model else torch.zeros(len(chunk), device=t.device)
        if bool((s >= float(_MIN_NORMAL)).all()) and bool(torch.isfinite(s).all()):
            q[a : a + rows] = (chunk / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            ok = (s > 0) & torch.isfinite(s)
            y = chunk / torch.where(ok, s, torch.ones_like(s))[:, None]
            y.clamp_(-FLOAT8_MAX, FLOAT8_MAX)
            piece = y.to(torch.float8_e4m3fn).view(torch.uint8)
            piece[s == 0] = 0
            bad = ~torch.isfinite(s)
            piece[bad] = NAN_BYTE
            s = torch.where(bad, torch.full_like(s, float("nan")), s)
            q[a : a + rows] = piece
        scales[a : a + rows] = s
    q_np = q.cpu().numpy().view(FLOAT8_DTYPE).reshape(shape)
    s_np = scales.cpu().numpy().reshape(shape[:-1])
    return q_np, s_np


# -- dequantizing ----------------------------------------------------------------------------

_TABLES: dict[str, npt.NDArray[Any]] = {}


def _table(kind: str) -> npt.NDArray[Any]:
    """``"single"``: float32 value of each of the 256 bytes (ml_dtypes'); ``"pair"``: of each
    of the 65536 little-endian byte pairs, as two float32 packed in a uint64 (512 KiB)."""
    table = _TABLES.get(kind)
    if table is None:
        single = np.arange(256, dtype=np.uint8).view(FLOAT8_DTYPE).astype(np.float32)
        if kind == "single":
            table = single
        else:
            pairs = np.arange(65536, dtype="<u2").view(np.uint8).reshape(-1, 2)
            table = np.ascontiguousarray(single[pairs]).reshape(-1).view("<u8")
        _TABLES[kind] = table
    return table


def check_range(scales: npt.NDArray[Any], dtype: str, where: str = "") -> None:
    """Raise `DtypeRangeError` if a vector with one of these scales does not fit ``dtype``
    once dequantized (only float16 can overflow: its largest finite value is 65504).

    Exact, and cheap (one value per vector): the largest dequantized value of a vector is
    ``RN32(448 * s)``, which rounds to float16 infinity from 65520 on.
    """
    if dtype != "float16" or scales.size == 0:
        return
    with np.errstate(invalid="ignore"):
        largest = np.float32(FLOAT8_MAX) * np.max(scales)  # a NaN scale (a NaN vector) never counts
    if largest >= _FLOAT16_OVERFLOW:
        raise DtypeRangeError(
            f"{where}float8_e4m3 values of up to {float(largest):.6g} do not fit float16 (largest finite "
            f"{FLOAT16_MAX:g}); read them as float32 or bfloat16: dtype='float32' (Shards.with_dtype, "
            "the read methods) or out_dtype='float32' (the loaders)"
        )


def dequantize(
    values: npt.NDArray[Any],
    scales: npt.NDArray[Any],
    dtype: str = "float16",
    out: npt.NDArray[Any] | None = None,
    *,
    checked: bool = False,
) -> npt.NDArray[Any]:
    """E4M3 ``values`` ``(..., D)`` (`FLOAT8_DTYPE` or their uint8 bytes) with their float32
    ``scales`` ``(...)``, dequantized into ``dtype`` (``"float16"`` or ``"float32"``):
    ``RN32(float32(q) * s)``, rounded to ``dtype``.

    Into ``out`` (a C-contiguous array of that dtype and shape) when given. `DtypeRangeError`
    when float16 cannot hold the values (`check_range`; ``checked``: the caller has checked).
    """
    want = OUT_DTYPES.get(dtype)
    if want is None:
        raise ValueError(f"dtype: expected one of {list(OUT_DTYPES)}, found {dtype!r}")
    shape = values.shape
    if scales.shape != shape[:-1]:
        raise ValueError(f"scales: expected shape {shape[:-1]} for values of shape {shape}, found {scales.shape}")
    if out is None:
        out = np.empty(shape, want)
    elif out.shape != shape or out.dtype != want or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous {want} array of shape {shape}, found {out.dtype} {out.shape}")
    if not checked:
        check_range(np.asarray(scales), dtype)
    d_model = shape[-1] if shape else 1
    if out.size == 0:
        return out
    codes = np.ascontiguousarray(values).view(np.uint8).reshape(-1, d_model)
    s = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    flat = out.reshape(-1, d_model)
    rows = _rows_per_chunk(d_model)
    wide = dtype == "float32"
    scratch = None if wide else np.empty((min(rows, len(codes)), d_model), np.float32)
    pairs = d_model % 2 == 0
    table = _table("pair" if pairs else "single")
    for a in range(0, len(codes), rows):
        b = min(a + rows, len(codes))
        dst = flat[a:b] if scratch is None else scratch[: b - a]
        if pairs:  # two values per lookup: half the gathers
            np.take(table, codes[a:b].view("<u2"), out=dst.view("<u8"), mode="clip")
        else:
            np.take(table, codes[a:b], out=dst, mode="clip")
        np.multiply(dst, s[a:b, None], out=dst)
        if scratch is not None:
            _narrow(dst, flat[a:b], dtype)
    return out


def _narrow(wide: npt.NDArray[np.float32], dest: npt.NDArray[Any], dtype: str) -> None:
    """``dest[...] = wide`` rounded to float16 (to nearest, ties to even)."""
    torch = sys.modules.get("torch")
    if torch is not None:  # vectorised, and rounds as numpy does; used when torch is already imported
        torch.from_numpy(dest).copy_(torch.from_numpy(wide))
        return
    with np.errstate(over="ignore"):  # beyond float16's range only when the caller skipped check_range
        np.copyto(dest, wide, casting="unsafe")


def error_bound(x: npt.NDArray[Any], scales: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """The largest error the rule allows for each value of ``x`` ``(..., D)`` stored with
    ``scales`` ``(...)`` and dequantized to float32: ``|x| / 16`` or ``s / 1024``, whichever is
    larger, plus the float32 roundings of the quotient and the product (a few units in the
    last place) and ``448 * 2**-150`` (what a subnormal or zero scale can lose: only for
    vectors whose largest value is below ~5.3e-36)."""
    x64 = np.abs(np.asarray(x, np.float64))
    s64 = np.asarray(scales, np.float64)[..., None]
    rounding = 4 * 2.0**-24 * (x64 + 448 * s64) + 448 * 2.0**-150
    return np.maximum(x64 / 16, s64 / 1024) + rounding


def dequantize_elementwise(values: npt.NDArray[Any], scales: npt.NDArray[Any], dtype: str) -> npt.NDArray[Any]:
    """`dequantize` where ``scales`` already has ``values``' shape (each value's vector's scale,
    as indexing a cache gives them): the same arithmetic, for arrays of any shape."""
    want = OUT_DTYPES.get(dtype)
    if want is None:
        raise ValueError(f"dtype: expected one of {list(OUT_DTYPES)}, found {dtype!r}")
    s = np.asarray(scales, np.float32)
    check_range(s, dtype)
    wide: npt.NDArray[np.float32] = np.asarray(np.multiply(_table("single")[np.asarray(values).view(np.uint8)], s))
    if dtype == "float32":
        return wide
    out = np.empty(wide.shape, want)
    _narrow(wide, out, dtype)
    return out
