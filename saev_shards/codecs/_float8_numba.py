"""float8_e4m3 in one pass, compiled by numba (the ``fast`` extra): dequantizing (below) and
quantizing (the rule, further down). `saev_shards.codecs.float8` uses these when numba
imports, and numpy (with torch's or ml_dtypes' cast) otherwise: the same bits either way.

Each kernel reads every stored byte once and writes its dequantized value once, in the
output dtype, with no array in between: the loop decodes a byte, multiplies it by its
vector's scale and rounds the product, and LLVM vectorises it (16 values per AVX-512
instruction here). numpy needs a pass over memory for each of those steps, and float16 out
of numpy is a scalar cast; torch's casts are vectorised but each call costs microseconds and
must stay below torch's parallel grain size on a loader's thread (`_float8_passes.TORCH_PIECE`).

The decoding is a relabelling, not a table: an E4M3 byte ``S EEEE MMM`` shifted so that its
sign lands on float32's sign and its 7 other bits on float32's exponent and mantissa, the
rest zero, is the float32 whose value is ``q * 2**-120`` exactly, for E4M3's normals and
subnormals alike (the latter become float32 subnormals). Multiplying it by ``s * 2**120``
(exact: a power of two, and ``|s| < 2**7`` keeps it finite) rounds ``q * s`` once, as
protocol.md 5 defines; a larger scale multiplies by ``2**120`` first (exact) and then by
``s``. The NaN codes (0x7F, 0xFF) give NaN. float16 is LLVM's ``fptrunc`` (a hardware
conversion, rounding to nearest even: vcvtps2ph on x86), bfloat16 the usual integer
rounding (nearest, ties to even, NaN as 0x7FC0, as `bfloat16.float32_to_bf16`).

Exact only where subnormal inputs are not flushed to zero: `saev_shards.codecs.float8` checks
that on the calling thread before each use, and compares the kernels with its numpy code on
every code and a range of scales once per process before trusting them.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
#: float32 with the value ``q * 2**-120``, from the byte's sign (bit 7 -> 31) and 7 other
#: bits (0..6 -> 20..26): ``(int32(int8(byte)) << 20) & _PLACED``.
_PLACED = 0x87F00000
_TWO_120 = np.float32(2.0**120)
#: Below this a scale times 2**120 stays finite (and exact).
_SMALL_SCALE = np.float32(2.0**7)


@intrinsic
def _decode(typingctx: Any, code: Any) -> Any:
    """float32 ``q * 2**-120`` of an E4M3 byte (``q`` its value), NaN codes aside."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        word = builder.shl(builder.sext(args[0], _I32), ir.Constant(_I32, 20))
        return builder.bitcast(builder.and_(word, ir.Constant(_I32, _PLACED)), ir.FloatType())

    return types.float32(types.uint8), codegen


@intrinsic
def _float16_bits(typingctx: Any, value: Any) -> Any:
    """The bits of ``value`` rounded to float16 (nearest, ties to even; LLVM's ``fptrunc``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(types.float32), codegen


@intrinsic
def _bfloat16_bits(typingctx: Any, value: Any) -> Any:
    """The bits of ``value`` rounded to bfloat16 (nearest, ties to even; NaN as 0x7FC0)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        word = builder.bitcast(args[0], _I32)
        odd = builder.and_(builder.lshr(word, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        rounded = builder.add(builder.add(word, ir.Constant(_I32, 0x7FFF)), odd)
        bits = builder.trunc(builder.lshr(rounded, ir.Constant(_I32, 16)), _I16)
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(nan, ir.Constant(_I16, 0x7FC0), bits)

    return types.uint16(types.float32), codegen


@intrinsic
def _nan_for_nan_codes(typingctx: Any, code: Any, value: Any) -> Any:
    """``value``, or NaN with the byte's sign where the byte is one of E4M3's NaNs (as ml_dtypes
    decodes them)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        code32 = builder.zext(args[0], _I32)
        is_nan = builder.icmp_unsigned("==", builder.and_(code32, ir.Constant(_I32, 0x7F)), ir.Constant(_I32, 0x7F))
        sign = builder.shl(builder.and_(code32, ir.Constant(_I32, 0x80)), ir.Constant(_I32, 24))
        nan = builder.bitcast(builder.or_(sign, ir.Constant(_I32, 0x7FC00000)), ir.FloatType())
        return builder.select(is_nan, nan, args[1])

    return types.float32(types.uint8, types.float32), codegen


# One kernel per output dtype: vectors ``(n, D)`` with their scales ``(n,)`` into ``out``
# ``(n, D)``, float16 and bfloat16 as their uint16 bits. Each row takes one of two loops, by
# its scale (one multiply, or two for a large one).


@numba.njit(nogil=True, inline="always")
def _row_float32(src: Any, dst: Any, scale: Any) -> None:
    if abs(scale) < _SMALL_SCALE:
        factor = scale * _TWO_120
        for j in range(src.shape[0]):
            dst[j] = _nan_for_nan_codes(src[j], _decode(src[j]) * factor)
    else:
        for j in range(src.shape[0]):
            dst[j] = _nan_for_nan_codes(src[j], (_decode(src[j]) * _TWO_120) * scale)


@numba.njit(nogil=True, inline="always")
def _row_float16(src: Any, dst: Any, scale: Any) -> None:
    if abs(scale) < _SMALL_SCALE:
        factor = scale * _TWO_120
        for j in range(src.shape[0]):
            dst[j] = _float16_bits(_nan_for_nan_codes(src[j], _decode(src[j]) * factor))
    else:
        for j in range(src.shape[0]):
            dst[j] = _float16_bits(_nan_for_nan_codes(src[j], (_decode(src[j]) * _TWO_120) * scale))


@numba.njit(nogil=True, inline="always")
def _row_bfloat16(src: Any, dst: Any, scale: Any) -> None:
    if abs(scale) < _SMALL_SCALE:
        factor = scale * _TWO_120
        for j in range(src.shape[0]):
            dst[j] = _bfloat16_bits(_nan_for_nan_codes(src[j], _decode(src[j]) * factor))
    else:
        for j in range(src.shape[0]):
            dst[j] = _bfloat16_bits(_nan_for_nan_codes(src[j], (_decode(src[j]) * _TWO_120) * scale))


@numba.njit(nogil=True, cache=True)
def dequantize_float32(codes: Any, scales: Any, out: Any) -> None:
    for i in range(codes.shape[0]):
        _row_float32(codes[i], out[i], scales[i])


@numba.njit(nogil=True, cache=True)
def dequantize_float16(codes: Any, scales: Any, out: Any) -> None:
    for i in range(codes.shape[0]):
        _row_float16(codes[i], out[i], scales[i])


@numba.njit(nogil=True, cache=True)
def dequantize_bfloat16(codes: Any, scales: Any, out: Any) -> None:
    for i in range(codes.shape[0]):
        _row_bfloat16(codes[i], out[i], scales[i])


# -- quantizing -------------------------------------------------------------------------------
#
# The rule of protocol.md 5 per vector: ``s = RN32(max|x| / 448)``; NaN bytes and a NaN scale
# for a vector holding inf or NaN, zeros for a zero scale, else ``E4M3(clamp(RN32(x / s)))``.
# The largest ``|x|`` is an integer maximum of the bits without their sign (the same order
# for floats; inf and NaN sort above every finite value), so the reduction vectorises. The
# E4M3 rounding (nearest, ties to even, as torch's and ml_dtypes' casts) is integer arithmetic
# on the float32 bits above E4M3's normal range (2**-6) and, below it, the float addition of
# 2**14, whose float32 spacing there is E4M3's subnormal step 2**-9. Clamping every quotient to
# 448 is the rule's clamp: only a subnormal scale carries a quotient past 464, where rounding
# would otherwise reach NaN, and below that the rounding gives 448 anyway.

_FLOAT32_INF = 0x7F800000


@intrinsic
def _abs_bits(typingctx: Any, value: Any) -> Any:
    """The bits of ``|value|`` as an int32 (ordered as the magnitudes are; inf and NaN above)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.and_(builder.bitcast(args[0], _I32), ir.Constant(_I32, 0x7FFFFFFF))

    return types.int32(types.float32), codegen


@intrinsic
def _float_of_bits(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _encode(typingctx: Any, value: Any) -> Any:
    """The E4M3 byte of a float32 ``|value| <= 448``, rounded to nearest, ties to even."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        def const(v: int) -> Any:
            return ir.Constant(_I32, v)

        bits = builder.bitcast(args[0], _I32)
        sign = builder.and_(builder.lshr(bits, const(24)), const(0x80))
        magnitude = builder.and_(bits, const(0x7FFFFFFF))
        # Normal: round off 20 mantissa bits (ties to even), rebias the exponent from 127 to 7.
        odd = builder.and_(builder.lshr(magnitude, const(20)), const(1))
        rounded = builder.add(builder.add(magnitude, const(0x7FFFF)), odd)
        normal = builder.sub(builder.lshr(rounded, const(20)), const((127 - 7) << 3))
        # Subnormal (and zero): |value| + 2**14 rounds |value| to a multiple of 2**-9.
        shifted = builder.fadd(builder.bitcast(magnitude, ir.FloatType()), ir.Constant(ir.FloatType(), 16384.0))
        subnormal = builder.sub(builder.bitcast(shifted, _I32), const(141 << 23))
        tiny = builder.icmp_signed("<", magnitude, const(121 << 23))  # below 2**-6
        code = builder.or_(builder.select(tiny, subnormal, normal), sign)
        return builder.trunc(code, ir.IntType(8))

    return types.uint8(types.float32), codegen


@numba.njit(nogil=True, cache=True)
def quantize_float32(x: Any, q: Any, scales: Any) -> None:
    """Vectors ``x`` ``(n, D)`` float32 into their E4M3 bytes ``q`` ``(n, D)`` uint8 and
    ``scales`` ``(n,)`` float32, by the rule."""
    for i in range(x.shape[0]):
        row, out = x[i], q[i]
        largest = np.int32(0)
        for j in range(row.shape[0]):
            largest = max(largest, _abs_bits(row[j]))
        if largest >= _FLOAT32_INF:  # inf or NaN
            out[:] = 0x7F
            scales[i] = np.float32(np.nan)
            continue
        s = _float_of_bits(largest) / np.float32(448.0)
        scales[i] = s
        if s == 0:
            out[:] = 0
            continue
        for j in range(row.shape[0]):
            out[j] = _encode(min(max(row[j] / s, np.float32(-448.0)), np.float32(448.0)))


#: The kernels by output dtype name.
DEQUANTIZE = {"float32": dequantize_float32, "float16": dequantize_float16, "bfloat16": dequantize_bfloat16}
