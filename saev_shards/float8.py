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
compares them).

Dequantizing moves each byte's bits into a float32 (``q * 2**-120``, exact; no table) and
multiplies by ``s * 2**120``: in one compiled pass per batch with numba (`float8_kernels`,
the ``fast`` extra), else in numpy passes over chunks that stay in cache, then rounds to
float16 (torch's vectorised cast when torch is imported) or bfloat16. Both give the bits of
ml_dtypes' values times the scale (tests compare them on every byte). On one core here, in
GB/s of float8 input: numba ~10-16, numpy ~3 (float32 out), where the table of byte pairs
this replaced ran at ~1.5 and ml_dtypes' and torch's float8 casts at ~0.17.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .errors import DtypeRangeError, ScaleError, SlowPathWarning
from .optional import install_hint

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
#: bfloat16's largest finite value (bits 0x7F7F), and the smallest float32 that rounds to
#: bfloat16 infinity (0x7F7F8000: the tie goes to the even 0x7F80, infinity).
BFLOAT16_MAX = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])
_BFLOAT16_OVERFLOW = np.array([0x7F7F8000], np.uint32).view(np.float32)[0]
#: The largest scale the rule gives, ``RN32(float32 max / 448)`` (7.595588e35): 448 times it is
#: float32's largest value, so no scale the rule gives turns a stored value into infinity.
MAX_SCALE = np.float32(np.finfo(np.float32).max) / np.float32(FLOAT8_MAX)
_MAX_SCALE_BITS = int(np.array(MAX_SCALE, np.float32).view(np.uint32))
#: The bits of the scale of a vector stored as NaN (rule 2 of the module docstring).
NAN_SCALE_BITS = 0x7FC00000
#: Values per step of the chunked numpy loops: their float32 scratch (512 KiB) stays in a
#: 1 MiB L2 cache; measured best of 2**14 to 2**19 here.
_CHUNK_VALUES = 1 << 17
#: Dtypes values are dequantized into.
OUT_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),  # its bits, as `saev_shards.dtypes` holds bfloat16
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
    return _quantize(arr, torch, _kernels())


def quantize_numpy(x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """`quantize` with numpy and ml_dtypes' cast only (what runs without torch and numba); the
    same bytes."""
    arr = np.asarray(x)
    _check_float(arr.dtype)
    return _quantize(arr, None, None)


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


def _quantize(arr: npt.NDArray[Any], torch: Any, kernels: Any) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """The rule over every vector of ``arr``, in chunks that stay in cache, on several threads
    for large inputs: by the compiled kernel when ``kernels`` is given (`float8_kernels`), else
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
    rows = _rows_per_chunk(d_model)
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
    return _quantize_torch(t)


def _quantize_torch(t: Any) -> tuple[Any, Any]:
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
    if not bool((s >= float(_MIN_NORMAL)).all()):  # one sync: the clamp acts only for subnormal scales
        y.clamp_(-FLOAT8_MAX, FLOAT8_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q[s == 0] = 0
    bad = ~torch.isfinite(s)
    q[bad] = NAN_BYTE
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return q.reshape(shape), s.reshape(shape[:-1])


# -- dequantizing ----------------------------------------------------------------------------
#
# Two implementations of one rule, the same bits (tests/unit/test_float8_kernels.py): the
# compiled kernels of `float8_kernels` (numba, the ``fast`` extra), one pass over the bytes,
# and numpy below, a pass per step over chunks that stay in cache. Both decode a byte by
# moving its bits into a float32 (``q * 2**-120``, exact), multiply by the scale times
# ``2**120`` and round to the output dtype.

#: ``(int32(int8(byte)) << 20) & _PLACED`` is the float32 ``q * 2**-120`` (float8_kernels).
_PLACED = np.array(0x87F00000, np.uint32).view(np.int32)
_TWO_120 = np.float32(2.0**120)
#: Below this a scale times 2**120 stays finite (exact: a power of two), one multiply suffices.
_SMALL_SCALE = np.float32(2.0**7)
#: A float32 subnormal: multiplied by 2**20 it stays 2**-120 unless this thread flushes
#: subnormal inputs to zero (x86's DAZ, set by torch.set_flush_denormal or -ffast-math code).
_SUBNORMAL = np.array([2.0**-140], np.float32)


def _subnormals_kept() -> bool:
    """Whether this thread's arithmetic reads subnormal floats as they are (then moving bytes
    into float32 bits is exact; otherwise a table of the 256 values is)."""
    return bool(np.multiply(_SUBNORMAL, np.float32(2.0**20))[0] == np.float32(2.0**-120))


#: ``[float8_kernels]`` once it has loaded and passed its check, ``[None]`` when it cannot be
#: used (numba not installed, failing here, or SAEV_SHARDS_NUMBA=0), empty before the first use.
_KERNELS: list[Any] = []
_KERNELS_LOCK = threading.Lock()


#: Not empty inside `numpy_only`.
_NUMPY_ONLY: list[bool] = []


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """Quantize and dequantize as without the ``fast`` extra inside this block, in every
    thread: numpy, with torch's E4M3 cast where torch is imported, else ml_dtypes'. For
    comparisons (scripts/bench_float8.py) and tests; the results are the same bits."""
    _NUMPY_ONLY.append(True)
    try:
        yield
    finally:
        _NUMPY_ONLY.pop()


def _kernels() -> Any:
    """The compiled kernels (`float8_kernels`) when they can be used on this thread, else None."""
    if _NUMPY_ONLY or not _subnormals_kept():
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
        from . import float8_kernels
    except ImportError as err:
        _NO_NUMBA.append(str(err))
        return None
    try:
        mismatch = _check_kernels(float8_kernels)
    except Exception as err:  # numba installed but unable to compile here: numpy does the work
        mismatch = f"{type(err).__name__}: {err}"
    if mismatch:
        warnings.warn(f"float8: numba's kernels are not used ({mismatch}); dequantizing with numpy", stacklevel=3)
        return None
    return float8_kernels


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
        _dequantize_numpy(codes, scales, expected, dtype)
        kernels.DEQUANTIZE[dtype](codes, scales, _bits(got))
        nan_equal = dtype != "bfloat16"  # bfloat16's NaN is one pattern; float16 and float32 NaNs compare as equal
        if not np.array_equal(got, expected, equal_nan=nan_equal):
            return f"its dequantizing to {dtype} differs from numpy's"
    # Quantizing: every finite E4M3 value (exact), values between them (rounding, ties), a
    # vector needing the clamp (subnormal scale), zeros, NaN and inf.
    finite = _values()[(np.arange(256) & 0x7F) != 0x7F]
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


# -- the scales a cache may hold ---------------------------------------------------------------
#
# The rule gives +0.0, a finite positive number up to MAX_SCALE, or the NaN 0x7FC00000 of a
# vector stored as NaN (whose bytes are all NAN_BYTE). As float32 bits, the first two are
# exactly the integers 0 .. _MAX_SCALE_BITS (positive floats order like their bits; a sign bit
# makes the bits larger): one maximum over the bits tells whether a batch of scales is all of
# them, the common case, before anything more is looked at.


def _scale_bits(scales: npt.NDArray[Any]) -> npt.NDArray[np.uint32]:
    s = np.asarray(scales, np.float32)
    if s.ndim and s.shape[-1] and s.strides[-1] == 0:  # one per value, broadcast over D: one per vector
        s = s[..., 0]
    return s.view(np.uint32)


def scales_plain(scales: npt.NDArray[Any]) -> bool:
    """True when every scale (float32, any shape) is +0.0 or a finite positive number of at most
    `MAX_SCALE`; one maximum over their bits. False: `odd_scales` tells which are what."""
    bits = _scale_bits(scales)
    return bits.size == 0 or int(bits.max()) <= _MAX_SCALE_BITS


def odd_scales(scales: npt.NDArray[Any]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Flat positions in ``scales`` (float32, any shape) of the scales the rule cannot give
    (inf, negative, -0.0, above `MAX_SCALE`, a NaN of other bits), and of the NaN scales
    0x7FC00000 (a vector stored as NaN: valid when its bytes are all `NAN_BYTE`, which only the
    caller holding them can tell)."""
    bits = np.asarray(scales, np.float32).reshape(-1).view(np.uint32)
    nan = bits == NAN_SCALE_BITS
    return np.flatnonzero((bits > _MAX_SCALE_BITS) & ~nan), np.flatnonzero(nan)


def describe_scale(value: object) -> str:
    """A scale the rule cannot give, in words: ``inf``, ``-2.5 (negative)``, ``1e+38 (above
    7.595588e+35)``, ``NaN 0xffc00000``."""
    v = np.float32(value)  # type: ignore[arg-type]
    bits = int(np.array(v, np.float32).view(np.uint32))
    if np.isnan(v):
        return f"NaN 0x{bits:08x}" + (" (a vector stored as NaN has bytes 0x7f)" if bits == NAN_SCALE_BITS else "")
    if np.isinf(v):
        return "inf" if v > 0 else "-inf"
    if bits >> 31:
        return f"{float(v):.7g} (negative)" if v else "-0.0 (negative zero)"
    return f"{float(v):.7g} (above {float(MAX_SCALE):.7g})"


#: What a valid scale is, for messages.
SCALE_RULE = (
    f"expected +0.0, a finite positive number of at most {float(MAX_SCALE):.7g} (float32's largest value over 448), "
    "or the NaN 0x7fc00000 of a vector stored as NaN (protocol.md 5)"
)


def check_range(scales: npt.NDArray[Any], dtype: str, where: str = "") -> None:
    """Raise `ScaleError` if a scale is not one the rule gives (`odd_scales`; where the scales
    came from is the caller's to say: the readers name the shard and the vector before this
    runs), and `DtypeRangeError` if a vector with one of these scales does not fit ``dtype``
    once dequantized: float16 (largest finite 65504) or, for scales within a few units of
    `MAX_SCALE`, bfloat16 (largest finite 3.3895e38).

    Exact, and cheap (one value per vector): the largest dequantized value of a vector is
    ``RN32(448 * s)``, which rounds to float16 infinity from 65520 on, and to bfloat16's from
    0x7F7F8000 (3.3961e38) on.
    """
    if scales.size == 0:
        return
    if not scales_plain(scales):
        odd, _ = odd_scales(scales)
        if odd.size:
            flat = np.asarray(scales, np.float32).reshape(-1)
            more = f" ({odd.size - 1} more)" if odd.size > 1 else ""
            raise ScaleError(
                f"{where}float8_e4m3 scales: {SCALE_RULE}, found {describe_scale(flat[odd[0]])} at position "
                f"{int(odd[0])} of {flat.size}{more}"
            )
    if dtype == "float32":
        return
    # fmax skips NaN scales (vectors stored as NaN: NaN in any dtype), so they hide no other.
    largest = np.float32(FLOAT8_MAX) * np.fmax.reduce(np.asarray(scales, np.float32), axis=None)
    if dtype == "float16" and largest >= _FLOAT16_OVERFLOW:
        raise DtypeRangeError(
            f"{where}float8_e4m3 values of up to {float(largest):.6g} do not fit float16 (largest finite "
            f"{FLOAT16_MAX:g}); read them as float32 or bfloat16: dtype='float32' (Shards.with_dtype, "
            "the read methods) or out_dtype='float32' (the loaders)"
        )
    if dtype == "bfloat16" and largest >= _BFLOAT16_OVERFLOW:
        raise DtypeRangeError(
            f"{where}float8_e4m3 values of up to {float(largest):.6g} do not fit bfloat16 (largest finite "
            f"{BFLOAT16_MAX:.5g}); read them as float32: dtype='float32' (Shards.with_dtype, the read methods) "
            "or out_dtype='float32' (the loaders)"
        )


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
        _dequantize_numpy(codes, s, flat, dtype)
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
    row where it lies (measured with numba, scripts/bench_float8.py's kernel table).
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
        _dequantize_numpy(codes, picked_scales, flat, dtype, flat_rows)
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


def _dequantize_numpy(
    codes: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    out: npt.NDArray[Any],
    dtype: str,
    take: npt.NDArray[np.integer[Any]] | None = None,
) -> None:
    """`dequantize` of ``codes`` ``(n, D)`` into ``out`` ``(n, D)`` with numpy, in chunks of
    `_CHUNK_VALUES` that stay in cache; float32 is computed in ``out`` itself. With ``take``,
    the rows ``take`` of ``codes`` instead (gathered a chunk at a time), with their ``scales``."""
    d_model = codes.shape[1]
    n = len(codes) if take is None else len(take)
    rows = _rows_per_chunk(d_model)
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
            biased = _decode(chunk, wide)
            if biased and bool((np.abs(s) < _SMALL_SCALE).all()):
                np.multiply(wide, s * _TWO_120, out=wide)
            else:
                if biased:
                    np.multiply(wide, _TWO_120, out=wide)
                np.multiply(wide, s, out=wide)
            _nan_codes(chunk, wide)
            if dtype == "float16":
                _narrow(wide, out[a:b])
            elif dtype == "bfloat16":
                round_bfloat16(wide, out[a:b])


def _decode(codes: npt.NDArray[np.uint8], wide: npt.NDArray[np.float32]) -> bool:
    """Write the bytes ``codes`` into ``wide`` as float32 ``q * 2**-120`` and return True; or,
    where this thread flushes subnormal inputs, as ``q`` (ml_dtypes' values) and return False."""
    if not _subnormals_kept():
        np.take(_values(), codes, out=wide)
        return False
    bits = wide.view(np.int32)
    np.copyto(bits, codes.view(np.int8), casting="unsafe")  # sign-extending: the sign bit to bit 31
    np.left_shift(bits, 20, out=bits)
    np.bitwise_and(bits, _PLACED, out=bits)
    return True


def _nan_codes(codes: npt.NDArray[np.uint8], wide: npt.NDArray[np.float32]) -> None:
    """NaN (with the byte's sign) where a byte is one of E4M3's NaNs, 0x7F or 0xFF: decoded as
    bits they would be a finite 480."""
    nan = (codes & 0x7F) == 0x7F
    if nan.any():
        wide[nan] = np.where(codes[nan] & 0x80, np.float32(-np.nan), np.float32(np.nan))


_VALUES: list[npt.NDArray[np.float32]] = []


def _values() -> npt.NDArray[np.float32]:
    """The float32 value of each of the 256 bytes (ml_dtypes')."""
    if not _VALUES:
        _VALUES.append(np.arange(256, dtype=np.uint8).view(FLOAT8_DTYPE).astype(np.float32))
    return _VALUES[0]


#: Elements per torch copy in `_narrow`: below torch's parallel grain size (32,768), so each copy
#: runs on the calling thread. Its intra-op threads would add to the loaders' gather threads,
#: and spin against them: on a busy 2-core machine a 4096 x 768 batch took 15x longer.
_TORCH_PIECE = 1 << 15


def _narrow(wide: npt.NDArray[np.float32], dest: npt.NDArray[Any]) -> None:
    """``dest[...] = wide`` rounded to float16 (to nearest, ties to even)."""
    torch = sys.modules.get("torch")
    if torch is not None:  # vectorised, and rounds as numpy does; used when torch is already imported
        src, dst = torch.from_numpy(wide).reshape(-1), torch.from_numpy(dest).reshape(-1)
        for a in range(0, len(src), _TORCH_PIECE):
            dst[a : a + _TORCH_PIECE].copy_(src[a : a + _TORCH_PIECE])
        return
    with np.errstate(over="ignore"):  # beyond float16's range only when the caller skipped check_range
        np.copyto(dest, wide, casting="unsafe")


def round_bfloat16(wide: npt.NDArray[np.float32], dest: npt.NDArray[np.uint16]) -> None:
    """``dest[...]`` = the bits of ``wide`` rounded to bfloat16 (to nearest, ties to even, as
    torch; NaN as 0x7FC0). ``wide`` is used as scratch: its values are lost."""
    nan = np.isnan(wide)
    bits = wide.view(np.uint32)
    odd = (bits >> 16) & np.uint32(1)
    bits += np.uint32(0x7FFF)
    bits += odd
    bits >>= 16
    np.copyto(dest, bits, casting="unsafe")
    if nan.any():
        dest[nan] = 0x7FC0


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
        if _decode(codes, wide):
            np.multiply(wide, _TWO_120, out=wide)
        np.multiply(wide, s, out=wide)
        _nan_codes(codes, wide)
        if dtype == "float32":
            return wide
        out = np.empty(wide.shape, want)
        if dtype == "float16":
            _narrow(wide, out)
        else:
            round_bfloat16(wide, out)
    return out
