"""The engines' passes over float8_e4m3 data in numpy and torch (`saev_shards.codecs.float8`
chooses among them and the compiled kernels of `_float8_numba`): the rule of
`saev_shards.protocol.float8` over vectors in chunks that stay in cache, on several threads
for large batches, and dequantizing without a table.

Quantizing uses torch's ``float8_e4m3fn`` cast when torch is installed: vectorised, about 8x
ml_dtypes' ufunc cast on this machine (4.7 against 0.58 GB/s of float32 input on one core).
Without torch it uses ml_dtypes'. Both round the same way, bit for bit (a hypothesis test
compares them).

Dequantizing moves each byte's bits into a float32 (``q * 2**-120``, exact; no table) and
multiplies by ``s * 2**120``, a pass per step over chunks that stay in cache, then rounds to
float16 (torch's vectorised cast when torch is imported) or bfloat16.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..protocol.float8 import FLOAT8_DTYPE, FLOAT8_MAX, MIN_NORMAL, NAN_BYTE
from .bfloat16 import round_bfloat16

#: Values per step of the chunked numpy loops: their float32 scratch (512 KiB) stays in a
#: 1 MiB L2 cache; measured best of 2**14 to 2**19 here.
CHUNK_VALUES = 1 << 17


def rows_per_chunk(d_model: int) -> int:
    return max(1, CHUNK_VALUES // max(1, d_model))


#: Threads quantizing one large batch, each a contiguous share of its vectors (numpy and
#: torch's casts release the GIL): the writer's caller thread is not the only core's work.
_QUANTIZE_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_POOLS: dict[int, ThreadPoolExecutor] = {}


def quantize_all(arr: npt.NDArray[Any], torch: Any, kernels: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """The rule over every vector of ``arr``, in chunks that stay in cache, on several threads
    for large inputs: by the compiled kernel when ``kernels`` is given (`_float8_numba`), else
    with numpy and torch's E4M3 cast when ``torch`` is given, else ml_dtypes'."""
    if arr.dtype.str not in ("<f2", "<f4", "<f8"):
        arr = arr.astype(np.float32)  # float128, big-endian: torch has no such dtype
    arr = np.ascontiguousarray(arr)
    shape = arr.shape
    d_model = shape[-1] if shape else 1
    flat = arr.reshape(-1, d_model)
    n = flat.shape[0]
    q = np.empty((n, d_model), np.uint8)
    scales = np.empty(n, np.float32)
    rows = rows_per_chunk(d_model)
    n_chunks = -(-n // rows)
    threads = min(_QUANTIZE_THREADS, n_chunks // 4)  # a thread only for a share of 4 chunks or more
    if threads <= 1:
        _quantize_rows(flat, q, scales, 0, n, rows, torch, kernels)
    else:
        pool = _POOLS.get(os.getpid())  # per process: a forked child has no threads of its parent's
        if pool is None:
            pool = _POOLS.setdefault(os.getpid(), ThreadPoolExecutor(_QUANTIZE_THREADS, "saev-shards-quantize"))
        bounds = [min(n, -(-n_chunks * i // threads) * rows) for i in range(threads + 1)]
        jobs = [
            pool.submit(_quantize_rows, flat, q, scales, a, b, rows, torch, kernels)
            for a, b in itertools.pairwise(bounds)
        ]
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
    kernels: Any,
) -> None:
    """Vectors ``[start, stop)`` of ``flat`` into ``q`` (bytes) and ``scales``, ``rows`` at a time.

    The compiled kernel, one pass per vector, when ``kernels`` is given. Otherwise numpy for
    the arithmetic (never multi-threaded), then the E4M3 cast: torch's copy into a
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
            if kernels is not None:
                kernels.quantize_float32(np.ascontiguousarray(chunk), q[a:b], scales[a:b])
                continue
            np.abs(chunk, out=absolute[: b - a])
            s = absolute[: b - a].max(axis=1) if d_model else np.zeros(b - a, np.float32)
            s /= np.float32(FLOAT8_MAX)
            y = scratch[: b - a]
            if bool((s >= MIN_NORMAL).all()) and bool(np.isfinite(s).all()):
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
    in pieces of `TORCH_PIECE` elements (each on the calling thread) when ``torch`` is given,
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
    for a in range(0, len(from_), TORCH_PIECE):
        to[a : a + TORCH_PIECE].copy_(from_[a : a + TORCH_PIECE])


def quantize_torch(t: Any) -> tuple[Any, Any]:
    """The rule in torch's ops on ``t``'s own device (`quantize_tensor` on a GPU; the tests run
    it on the CPU too). Every division is by a tensor on that device, never by a Python
    number: on CUDA torch divides by a number as a multiplication by its reciprocal, which
    is one bit off the rule's division for about half of all scales (x / 448)."""
    import torch

    if t.dtype != torch.float32:
        t = t.to(torch.float32)  # on its own device: float32 is what the rule divides
    t = t.contiguous()
    shape = tuple(t.shape)
    d_model = shape[-1] if shape else 1
    flat = t.reshape(-1, d_model)
    largest = torch.full((), FLOAT8_MAX, dtype=torch.float32, device=t.device)
    s = torch.amax(flat.abs(), dim=1) / largest if d_model else torch.zeros(len(flat), device=t.device)
    ok = (s > 0) & torch.isfinite(s)
    y = flat / torch.where(ok, s, torch.ones_like(s))[:, None]
    if not bool((s >= float(MIN_NORMAL)).all()):  # one sync: the clamp acts only for subnormal scales
        y.clamp_(-FLOAT8_MAX, FLOAT8_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q[s == 0] = 0
    bad = ~torch.isfinite(s)
    q[bad] = NAN_BYTE
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return q.reshape(shape), s.reshape(shape[:-1])


# -- dequantizing ----------------------------------------------------------------------------
#
# Two implementations of one rule, the same bits (tests/unit/codecs/test_float8_numba.py): the
# compiled kernels of `_float8_numba` (numba, the ``fast`` extra), one pass over the bytes,
# and numpy below, a pass per step over chunks that stay in cache. Both decode a byte by
# moving its bits into a float32 (``q * 2**-120``, exact), multiply by the scale times
# ``2**120`` and round to the output dtype.

#: ``(int32(int8(byte)) << 20) & _PLACED`` is the float32 ``q * 2**-120`` (`_float8_numba`).
_PLACED = np.array(0x87F00000, np.uint32).view(np.int32)
TWO_120 = np.float32(2.0**120)
#: Below this a scale times 2**120 stays finite (exact: a power of two), one multiply suffices.
SMALL_SCALE = np.float32(2.0**7)
#: A float32 subnormal: multiplied by 2**20 it stays 2**-120 unless this thread flushes
#: subnormal inputs to zero (x86's DAZ, set by torch.set_flush_denormal or -ffast-math code).
_SUBNORMAL = np.array([2.0**-140], np.float32)


def subnormals_kept() -> bool:
    """Whether this thread's arithmetic reads subnormal floats as they are (then moving bytes
    into float32 bits is exact; otherwise a table of the 256 values is)."""
    return bool(np.multiply(_SUBNORMAL, np.float32(2.0**20))[0] == np.float32(2.0**-120))


def dequantize_rows(
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    out: npt.NDArray[Any],
    dtype: str,
    take: npt.NDArray[np.integer[Any]] | None = None,
) -> None:
    """`dequantize` of ``codes`` ``(n, D)`` into ``out`` ``(n, D)`` with numpy, in chunks of
    `CHUNK_VALUES` that stay in cache; float32 is computed in ``out`` itself. With ``take``,
    the rows ``take`` of ``codes`` instead (gathered a chunk at a time), with their ``scales``."""
    d_model = codes.shape[1]
    n = len(codes) if take is None else len(take)
    rows = rows_per_chunk(d_model)
    scratch = None if dtype == "float32" else np.empty((min(rows, n), d_model), np.float32)
    picked = None if take is None else np.empty((min(rows, n), d_model), np.uint8)
    with np.errstate(all="ignore"):  # NaN vectors, and scales beyond float16 when the caller skipped check_range
        for a in range(0, n, rows):
            b = min(a + rows, n)
            wide = out[a:b] if scratch is None else scratch[: b - a]
            s = scales[a:b, None]
            if picked is None:
                chunk = codes[a:b]
            else:
                assert take is not None
                chunk = np.take(codes, take[a:b], axis=0, out=picked[: b - a], mode="clip")
            biased = decode(chunk, wide)
            if biased and bool((np.abs(s) < SMALL_SCALE).all()):
                np.multiply(wide, s * TWO_120, out=wide)
            else:
                if biased:
                    np.multiply(wide, TWO_120, out=wide)
                np.multiply(wide, s, out=wide)
            nan_codes(chunk, wide)
            if dtype == "float16":
                narrow(wide, out[a:b])
            elif dtype == "bfloat16":
                round_bfloat16(wide, out[a:b])


def decode(codes: npt.NDArray[np.uint8], wide: npt.NDArray[np.float32]) -> bool:
    """Write the bytes ``codes`` into ``wide`` as float32 ``q * 2**-120`` and return True; or,
    where this thread flushes subnormal inputs, as ``q`` (ml_dtypes' values) and return False."""
    if not subnormals_kept():
        np.take(byte_values(), codes, out=wide)
        return False
    bits = wide.view(np.int32)
    np.copyto(bits, codes.view(np.int8), casting="unsafe")  # sign-extending: the sign bit to bit 31
    np.left_shift(bits, 20, out=bits)
    np.bitwise_and(bits, _PLACED, out=bits)
    return True


def nan_codes(codes: npt.NDArray[np.uint8], wide: npt.NDArray[np.float32]) -> None:
    """NaN (with the byte's sign) where a byte is one of E4M3's NaNs, 0x7F or 0xFF: decoded as
    bits they would be a finite 480."""
    nan = (codes & 0x7F) == 0x7F
    if nan.any():
        wide[nan] = np.where(codes[nan] & 0x80, np.float32(-np.nan), np.float32(np.nan))


_VALUES: list[npt.NDArray[np.float32]] = []


def byte_values() -> npt.NDArray[np.float32]:
    """The float32 value of each of the 256 bytes (ml_dtypes')."""
    if not _VALUES:
        _VALUES.append(np.arange(256, dtype=np.uint8).view(FLOAT8_DTYPE).astype(np.float32))
    return _VALUES[0]


#: Elements per torch copy in `narrow`: below torch's parallel grain size (32,768), so each copy
#: runs on the calling thread. Its intra-op threads would add to the loaders' gather threads,
#: and spin against them: on a busy 2-core machine a 4096 x 768 batch took 15x longer.
TORCH_PIECE = 1 << 15


def narrow(wide: npt.NDArray[np.float32], dest: npt.NDArray[Any]) -> None:
    """``dest[...] = wide`` rounded to float16 (to nearest, ties to even)."""
    torch = sys.modules.get("torch")
    if torch is not None:  # vectorised, and rounds as numpy does; used when torch is already imported
        src, dst = torch.from_numpy(wide).reshape(-1), torch.from_numpy(dest).reshape(-1)
        for a in range(0, len(src), TORCH_PIECE):
            dst[a : a + TORCH_PIECE].copy_(src[a : a + TORCH_PIECE])
        return
    with np.errstate(over="ignore"):  # beyond float16's range only when the caller skipped check_range
        np.copyto(dest, wide, casting="unsafe")
