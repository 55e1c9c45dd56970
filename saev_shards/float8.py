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

import itertools
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
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
#: Values per step of the chunked loops: their float32 scratch (512 KiB) and the pair table
#: (512 KiB) stay in a 1 MiB L2 cache; measured best of 2**14 to 2**19 here.
_CHUNK_VALUES = 1 << 17
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
    return _quantize(arr, torch)


def quantize_numpy(x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """`quantize` with ml_dtypes' cast only (what runs without torch); the same bytes."""
    arr = np.asarray(x)
    _check_float(arr.dtype)
    return _quantize(arr, None)


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


#: Threads quantizing one large batch, each a contiguous share of its vectors (numpy and
#: torch's casts release the GIL): the writer's caller thread is not the only core's work.
_QUANTIZE_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _quantize(arr: npt.NDArray[Any], torch: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """The rule over every vector of ``arr``, in chunks that stay in cache, on several threads
    for large inputs. The E4M3 cast is torch's when ``torch`` is given, else ml_dtypes'."""
    if arr.dtype.str not in ("<f2", "<f4", "<f8"):
        arr = arr.astype(np.float32)  # float128, big-endian: torch has no such dtype
    arr = np.ascontiguousarray(arr)
    shape = arr.shape
    d_model = shape[-1] if shape else 1
    flat = arr.reshape(-1, d_model)
    n = flat.shape[0]
    q = np.empty((n, d_model), np.uint8)
    scales = np.empty(n, np.float32)
    rows = _rows_per_chunk(d_model)
    n_chunks = -(-n // rows)
    threads = min(_QUANTIZE_THREADS, n_chunks // 4)  # a thread only for a share of 4 chunks or more
    if threads <= 1:
        _quantize_rows(flat, q, scales, 0, n, rows, torch)
    else:
        pool = _POOLS.get(os.getpid())  # per process: a forked child has no threads of its parent's
        if pool is None:
            pool = _POOLS.setdefault(os.getpid(), ThreadPoolExecutor(_QUANTIZE_THREADS, "saev-shards-quantize"))
        bounds = [min(n, -(-n_chunks * i // threads) * rows) for i in range(threads + 1)]
        jobs = [pool.submit(_quantize_rows, flat, q, scales, a, b, rows, torch) for a, b in itertools.pairwise(bounds)]
        for job in jobs:
            job.result()
    return q.view(FLOAT8_DTYPE).reshape(shape), scales.reshape(shape[:-1])


def _quantize_rows(
    flat: npt.NDArray[Any],
    q: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    start: int,
    stop: int,
    rows: int,
    torch: Any,
) -> None:
    """Vectors ``[start, stop)`` of ``flat`` into ``q`` (bytes) and ``scales``, ``rows`` at a time.

    numpy for the arithmetic (never multi-threaded), then the E4M3 cast: torch's copy into a
    float8_e4m3fn view, in pieces below its parallel grain so it stays on this thread (its
    intra-op threads would spin against ours on a busy machine), or ml_dtypes' ``astype``.
    """
    d_model = flat.shape[1]
    absolute = np.empty((rows, d_model), np.float32)
    scratch = np.empty((rows, d_model), np.float32)
    with np.errstate(all="ignore"):  # NaN rows and subnormal scales are dealt with below
        for a in range(start, stop, rows):
            b = min(stop, a + rows)
            chunk = flat[a:b]
            if chunk.dtype != np.float32:
                _copy(chunk, scratch[: b - a], torch)  # float32 is what the rule divides
                chunk = scratch[: b - a]
            np.abs(chunk, out=absolute[: b - a])
            s = absolute[: b - a].max(axis=1) if d_model else np.zeros(b - a, np.float32)
            s /= np.float32(FLOAT8_MAX)
            y = scratch[: b - a]
            if bool((s >= _MIN_NORMAL).all()) and bool(np.isfinite(s).all()):
                np.divide(chunk, s[:, None], out=y)
                _copy(y, q[a:b].view(FLOAT8_DTYPE), torch)
            else:
                ok = (s > 0) & np.isfinite(s)
                np.divide(chunk, np.where(ok, s, np.float32(1))[:, None], out=y)
                np.clip(y, -FLOAT8_MAX, FLOAT8_MAX, out=y)
                _copy(y, q[a:b].view(FLOAT8_DTYPE), torch)
                q[a:b][s == 0] = 0
                bad = ~np.isfinite(s)
                q[a:b][bad] = NAN_BYTE
                s[bad] = np.float32(np.nan)
            scales[a:b] = s


def _copy(src: npt.NDArray[Any], dest: npt.NDArray[Any], torch: Any) -> None:
    """``dest[...] = src`` cast to ``dest``'s dtype (rounding to nearest, ties to even): by torch
    in pieces of `_TORCH_PIECE` elements (each on the calling thread) when ``torch`` is given,
    else by numpy (and ml_dtypes for E4M3)."""
    if torch is None:
        dest[...] = src.astype(dest.dtype)
        return
    with warnings.catch_warnings():  # a read-only source (a memmap slice) is only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        from_ = torch.from_numpy(src.reshape(-1))
    if dest.dtype == FLOAT8_DTYPE:  # numpy knows ml_dtypes' dtype, torch only its bytes
        to = torch.from_numpy(dest.reshape(-1).view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        to = torch.from_numpy(dest.reshape(-1))
    for a in range(0, len(from_), _TORCH_PIECE):
        to[a : a + _TORCH_PIECE].copy_(from_[a : a + _TORCH_PIECE])


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
    if t.dtype != torch.float32:
        t = t.to(torch.float32)  # on its own device: float32 is what the rule divides
    t = t.contiguous()
    shape = tuple(t.shape)
    d_model = shape[-1] if shape else 1
    flat = t.reshape(-1, d_model)
    s = torch.amax(flat.abs(), dim=1) / FLOAT8_MAX if d_model else torch.zeros(len(flat), device=t.device)
    ok = (s > 0) & torch.isfinite(s)
    y = flat / torch.where(ok, s, torch.ones_like(s))[:, None]
    if not bool((s >= float(_MIN_NORMAL)).all()):  # one sync: the clamp acts only for subnormal scales
        y.clamp_(-FLOAT8_MAX, FLOAT8_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q[s == 0] = 0
    bad = ~torch.isfinite(s)
    q[bad] = NAN_BYTE
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return q.reshape(shape), s.reshape(shape[:-1])


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
    # fmax skips NaN scales (vectors stored as NaN: NaN in any dtype), so they hide no other.
    largest = np.float32(FLOAT8_MAX) * np.fmax.reduce(scales, axis=None)
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


#: Elements per torch copy in `_narrow`: below torch's parallel grain size (32,768), so each copy
#: runs on the calling thread. Its intra-op threads would add to the loaders' gather threads,
#: and spin against them: on a busy 2-core machine a 4096 x 768 batch took 15x longer.
_TORCH_PIECE = 1 << 15


def _narrow(wide: npt.NDArray[np.float32], dest: npt.NDArray[Any], dtype: str) -> None:
    """``dest[...] = wide`` rounded to float16 (to nearest, ties to even)."""
    torch = sys.modules.get("torch")
    if torch is not None:  # vectorised, and rounds as numpy does; used when torch is already imported
        src, dst = torch.from_numpy(wide).reshape(-1), torch.from_numpy(dest).reshape(-1)
        for a in range(0, len(src), _TORCH_PIECE):
            dst[a : a + _TORCH_PIECE].copy_(src[a : a + _TORCH_PIECE])
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
