"""float8_e4m3 with one float32 scale per vector (protocol.md section 5): the scale rule, the
scales a cache may hold, and a numpy reference of quantizing and dequantizing.

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

`reference_quantize` and `reference_dequantize` are the rule written out in whole-array numpy
with ml_dtypes' casts: slow and plain, what the engines of `saev_shards.codecs.float8` (torch,
numba, chunked numpy passes on threads) are compared with. `check_range` is the check every
read makes of the scales it is given (`ScaleError`, `DtypeRangeError`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ..errors import DtypeRangeError, ScaleError

#: The numpy dtype of stored E4M3 values (ml_dtypes' float8_e4m3fn: no infinities, largest 448).
FLOAT8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
#: Largest finite E4M3 value: the largest |value| of every vector is stored as it.
FLOAT8_MAX = 448.0
#: The bytes of a vector that held inf or NaN (E4M3's positive NaN).
NAN_BYTE = 0x7F
#: Smallest normal float32: below it a scale is subnormal and the clamp of the rule can act.
MIN_NORMAL = np.float32(2.0**-126)
#: float16's largest finite value, and the smallest float32 that rounds to float16 infinity.
FLOAT16_MAX = 65504.0
FLOAT16_OVERFLOW = np.float32(65520.0)
#: bfloat16's largest finite value (bits 0x7F7F), and the smallest float32 that rounds to
#: bfloat16 infinity (0x7F7F8000: the tie goes to the even 0x7F80, infinity).
BFLOAT16_MAX = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])
BFLOAT16_OVERFLOW = np.array([0x7F7F8000], np.uint32).view(np.float32)[0]
#: The largest scale the rule gives, ``RN32(float32 max / 448)`` (7.595588e35): 448 times it is
#: float32's largest value, so no scale the rule gives turns a stored value into infinity.
MAX_SCALE = np.float32(np.finfo(np.float32).max) / np.float32(FLOAT8_MAX)
MAX_SCALE_BITS = int(np.array(MAX_SCALE, np.float32).view(np.uint32))
#: The bits of the scale of a vector stored as NaN (rule 2 of the module docstring).
NAN_SCALE_BITS = 0x7FC00000
#: The dtypes values are dequantized into, by name (bfloat16 as its uint16 bits).
OUT_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),
}


# -- the rule, written out ---------------------------------------------------------------------


def reference_quantize(x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """The rule over every vector of ``x`` ``(..., D)`` (any float dtype, rounded to float32
    first): ``(values, scales)``, E4M3 values of ``x``'s shape (`FLOAT8_DTYPE`) and float32
    scales ``x.shape[:-1]``. Whole-array numpy and ml_dtypes' cast: the bytes every engine of
    `saev_shards.codecs.float8` gives, slowly."""
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise TypeError(f"expected floating-point activations, found dtype {arr.dtype}")
    x32 = arr.astype(np.float32)
    with np.errstate(all="ignore"):  # NaN vectors, and zero or subnormal scales: dealt with below
        largest = np.abs(x32).max(axis=-1) if x32.shape[-1] else np.zeros(x32.shape[:-1], np.float32)
        scales = np.array(largest / np.float32(FLOAT8_MAX), np.float32)  # an array even for one vector
        usable = (scales > 0) & np.isfinite(scales)
        quotient = x32 / np.where(usable, scales, np.float32(1))[..., None]
        values = np.clip(quotient, -FLOAT8_MAX, FLOAT8_MAX).astype(FLOAT8_DTYPE)
    codes = values.view(np.uint8)
    codes[scales == 0] = 0
    nan = ~np.isfinite(scales)
    codes[nan] = NAN_BYTE
    scales[nan] = np.float32(np.nan)  # the bits 0x7FC00000
    return values, scales


def reference_dequantize(
    values: npt.NDArray[Any], scales: npt.NDArray[Any], dtype: str = "float32"
) -> npt.NDArray[Any]:
    """E4M3 ``values`` ``(..., D)`` (`FLOAT8_DTYPE` or their bytes) with their ``scales``
    ``(...)`` as ``dtype`` (one of `OUT_DTYPES`; bfloat16 as its uint16 bits, every NaN
    0x7FC0): ``RN32(float32(q) * s)`` rounded to ``dtype``, in whole-array numpy and
    ml_dtypes' casts."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype: expected one of {list(OUT_DTYPES)}, found {dtype!r}")
    wide: npt.NDArray[np.float32] = np.asarray(values).view(FLOAT8_DTYPE).astype(np.float32)
    with np.errstate(all="ignore"):
        wide *= np.asarray(scales, np.float32)[..., None]
        if dtype == "float32":
            return wide
        if dtype == "float16":
            return wide.astype(np.float16)
    bits: npt.NDArray[np.uint16] = wide.astype(ml_dtypes.bfloat16).view(np.uint16)
    bits[np.isnan(wide)] = 0x7FC0
    return bits


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


# -- the scales a cache may hold ---------------------------------------------------------------
#
# The rule gives +0.0, a finite positive number up to MAX_SCALE, or the NaN 0x7FC00000 of a
# vector stored as NaN (whose bytes are all NAN_BYTE). As float32 bits, the first two are
# exactly the integers 0 .. MAX_SCALE_BITS (positive floats order like their bits; a sign bit
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
    return bits.size == 0 or int(bits.max()) <= MAX_SCALE_BITS


def odd_scales(scales: npt.NDArray[Any]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Flat positions in ``scales`` (float32, any shape) of the scales the rule cannot give
    (inf, negative, -0.0, above `MAX_SCALE`, a NaN of other bits), and of the NaN scales
    0x7FC00000 (a vector stored as NaN: valid when its bytes are all `NAN_BYTE`, which only the
    caller holding them can tell)."""
    bits = np.asarray(scales, np.float32).reshape(-1).view(np.uint32)
    nan = bits == NAN_SCALE_BITS
    return np.flatnonzero((bits > MAX_SCALE_BITS) & ~nan), np.flatnonzero(nan)


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
    if dtype == "float16" and largest >= FLOAT16_OVERFLOW:
        raise DtypeRangeError(
            f"{where}float8_e4m3 values of up to {float(largest):.6g} do not fit float16 (largest finite "
            f"{FLOAT16_MAX:g}); read them as float32 or bfloat16: dtype='float32' (Shards.with_dtype, "
            "the read methods) or out_dtype='float32' (the loaders)"
        )
    if dtype == "bfloat16" and largest >= BFLOAT16_OVERFLOW:
        raise DtypeRangeError(
            f"{where}float8_e4m3 values of up to {float(largest):.6g} do not fit bfloat16 (largest finite "
            f"{BFLOAT16_MAX:.5g}); read them as float32: dtype='float32' (Shards.with_dtype, the read methods) "
            "or out_dtype='float32' (the loaders)"
        )
