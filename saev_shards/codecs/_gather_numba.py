"""A loader's gathers and window indexes compiled by numba (the ``fast`` extra):
`saev_shards.codecs.gather` uses these when numba imports and they match its numpy code, and
numpy otherwise: the same values either way.

* ``take_widen_*``: rows of stored values (float16 or bfloat16, as their uint16 bits) gathered
  and widened to float32 in one pass, where numpy gathers into a scratch array and casts it in
  a second pass over the output. float16 is widened by the hardware conversion (exact; NaN made
  quiet, as torch's cast), bfloat16 by a shift.
* ``window_index`` and ``window_index_listed``: a window's units, in the order the batches take
  them, to the columns of its index (the row each is gathered from, its example, token, layer
  and label), one pass over the units, from their numbers (a window whose examples all hold the
  same tokens) or from the listed units of a window whose examples differ. numpy needs a pass
  over memory, and a temporary array, for each ``divmod`` and gather of those steps.

Every kernel releases the GIL (``nogil``): a loader's threads run them side by side.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def _half_to_float_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 bits of float16 bits ``bits``: LLVM's ``fpext`` (the hardware conversion,
    vcvtph2ps on x86: exact, NaN made quiet, as torch's cast; vectorised, 16 values an
    instruction with AVX-512)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.bitcast(builder.fpext(half, ir.FloatType()), ir.IntType(32))

    return types.uint32(types.uint16), codegen


@numba.njit(nogil=True, cache=True, error_model="numpy")
def take_widen_float16(src: Any, rows: Any, out: Any) -> None:
    """``out[i] = float32(src[clip(rows[i])])``: ``src`` ``(W, D)`` float16 bits, ``out`` ``(n, D)``
    float32 bits (uint32)."""
    last = src.shape[0] - 1
    for i in range(rows.shape[0]):
        r = min(max(rows[i], 0), last)
        s, d = src[r], out[i]
        for j in range(s.shape[0]):
            d[j] = _half_to_float_bits(s[j])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def take_widen_bfloat16(src: Any, rows: Any, out: Any) -> None:
    """``out[i] = float32(src[clip(rows[i])])``: ``src`` ``(W, D)`` bfloat16 bits, ``out`` ``(n, D)``
    float32 bits (uint32)."""
    last = src.shape[0] - 1
    for i in range(rows.shape[0]):
        r = min(max(rows[i], 0), last)
        s, d = src[r], out[i]
        for j in range(s.shape[0]):
            d[j] = np.uint32(s[j]) << np.uint32(16)


@numba.njit(nogil=True, inline="always")
def _divide(n: Any, d: Any, inverse: Any) -> Any:
    """``n // d`` for ``0 <= n < 2**52``, ``d >= 1``, ``inverse = 1 / d``: a multiply, corrected by
    one either way (a 64-bit division takes tens of cycles; numpy divides by a scalar with
    libdivide's multiplies)."""
    q = np.int64(np.float64(n) * inverse)
    if q * d > n:
        q -= 1
    elif (q + 1) * d <= n:
        q += 1
    return q


# The index kernels take their arrays in groups (tuples): ``units`` ``(lo, per_ex, slots,
# chosen)`` or ``listed`` ``(example, slot, token)`` of each unit; ``rows`` ``(first vector of each
# example, offset of each slot, offsets of the stacked slots or empty, global example of each
# example, layer of each slot, labels (flat) or empty, tokens per example)``; ``out`` ``(flat,
# examples, tokens, layers or empty, labels or empty)``.


@numba.njit(nogil=True, inline="always")
def _put_unit(u: Any, ex: Any, tok: Any, slot_of: Any, j: Any, rows: Any, out: Any) -> None:
    """Row ``u`` of a window's index: token ``tok`` of example ``ex`` (in the window) at slot
    ``slot_of[j]`` (every stacked slot when ``rows`` has stacked offsets: ``slot_of`` is not
    read then), with its example, token, layer and label."""
    ex_vector, slot_vector, stack_offsets, examples, slot_layer, labels, tokens_per_ex = rows
    flat, ex_out, tok_out, layer_out, label_out = out
    first = ex_vector[ex] + tok
    if stack_offsets.shape[0] != 0:
        for k in range(stack_offsets.shape[0]):
            flat[u, k] = first + stack_offsets[k]
    else:
        slot = slot_of[j]
        flat[u, 0] = first + slot_vector[slot]
        layer_out[u] = slot_layer[slot]
    ex_out[u] = examples[ex]
    tok_out[u] = tok
    if label_out.shape[0] != 0:
        label_out[u] = labels[ex * tokens_per_ex + tok]


@numba.njit(nogil=True, cache=True, error_model="numpy")
def window_index(order: Any, units: Any, rows: Any, out: Any) -> None:
    """The index of a window whose examples all hold the ``chosen`` tokens: unit ``u`` of the
    batches is unit number ``lo + order[u]`` (``lo + u`` when ``order`` is empty), in example,
    slot, token order."""
    lo, per_ex, slots, chosen = units
    flat = out[0]
    n_chosen = np.int64(chosen.shape[0])
    per_ex_inverse, chosen_inverse = 1.0 / per_ex, 1.0 / n_chosen
    ordered = order.shape[0] != 0
    for u in range(flat.shape[0]):
        unit = lo + (order[u] if ordered else u)
        ex = _divide(unit, per_ex, per_ex_inverse)
        rest = unit - ex * per_ex
        s = _divide(rest, n_chosen, chosen_inverse)
        _put_unit(u, ex, chosen[rest - s * n_chosen], slots, s, rows, out)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def window_index_listed(order: Any, listed: Any, rows: Any, out: Any) -> None:
    """The index of a window from its listed units ``(ex_c, slot_c, tok_c)``: unit ``u`` of the
    batches is listed unit ``order[u]`` (``u`` when ``order`` is empty)."""
    ex_c, slot_c, tok_c = listed
    flat = out[0]
    ordered = order.shape[0] != 0
    for u in range(flat.shape[0]):
        i = order[u] if ordered else u
        _put_unit(u, ex_c[i], tok_c[i], slot_c, i, rows, out)
