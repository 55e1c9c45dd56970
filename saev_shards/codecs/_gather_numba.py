"""A loader's gathers and window indexes compiled by numba (the ``fast`` extra):
`saev_shards.codecs.gather` uses these when numba imports and they match its numpy code, and
numpy otherwise: the same values either way.

* ``take_widen_*``: rows of stored values (float16 or bfloat16, as their uint16 bits) gathered
  and widened to float32 in one pass, where numpy gathers into a scratch array and casts it in
  a second pass over the output. float16 is widened by the hardware conversion (exact; NaN made
  quiet, as torch's cast), bfloat16 by a shift.
* ``window_index``: a window's units, in the order the batches take
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


# The index kernel takes its arrays in groups (tuples): ``units`` ``(lo, per_ex, slots, chosen)``
# (a window whose examples all hold the same tokens) and ``listed`` ``(example, slot, token)`` of
# each unit (empty arrays unless the units are listed); ``rows`` ``(first vector of each example,
# offset of each slot, offsets of the stacked slots or empty, global example of each example,
# layer of each slot, labels (flat) or empty, tokens per example)``; ``out`` ``(flat, examples,
# tokens, layers or empty, labels or empty)``.
#
# Every tuple is unpacked once, before the loop, and the loop's body is written out in it: an
# array unpacked from a tuple, or passed to a function (even one inlined), inside the loop costs
# a reference count taken and dropped per array and per unit (atomic operations numba does not
# prune), which made this kernel about 12 times slower (65 ms against 5 ms for a 1 GiB window
# of 696,192 units on this machine).


@numba.njit(nogil=True, cache=True, error_model="numpy")
def window_index(order: Any, units: Any, listed: Any, rows: Any, out: Any) -> None:
    """The index of a window: batch unit ``u`` is unit ``i = order[u]`` (``u`` when ``order`` is
    empty): listed unit ``i`` where ``listed`` has units, else unit number ``lo + i`` in example,
    slot, token order of a window whose examples all hold the ``chosen`` tokens."""
    lo, per_ex, slots, chosen = units
    ex_c, slot_c, tok_c = listed
    ex_vector, slot_vector, stack_offsets, examples, slot_layer, labels, tokens_per_ex = rows
    flat, ex_out, tok_out, layer_out, label_out = out
    n_chosen = np.int64(chosen.shape[0])
    per_ex_inverse = 1.0 / per_ex if per_ex > 0 else 0.0
    chosen_inverse = 1.0 / n_chosen if n_chosen > 0 else 0.0
    ordered = order.shape[0] != 0
    is_listed = ex_c.shape[0] != 0
    n_stacked = stack_offsets.shape[0]
    has_labels = label_out.shape[0] != 0
    # In order (no ``order``, units numbered): the next unit's example, slot and token counted up
    # from the first's, not divided out of each unit number (the OrderedLoader's windows: their
    # index in 3.0 instead of 5.8 ms/GB on the development machine).
    counted = not ordered and not is_listed and n_chosen > 0
    n_slots = per_ex // n_chosen if counted else 0
    next_ex = next_s = next_c = np.int64(0)
    if counted:
        next_ex = _divide(lo, per_ex, per_ex_inverse)
        next_s = _divide(lo - next_ex * per_ex, n_chosen, chosen_inverse)
        next_c = lo - next_ex * per_ex - next_s * n_chosen
    for u in range(flat.shape[0]):
        i = order[u] if ordered else u
        if is_listed:
            ex, tok, slot = ex_c[i], tok_c[i], slot_c[i]
        elif counted:
            ex, tok, slot = next_ex, chosen[next_c], slots[next_s]
            next_c += 1
            if next_c == n_chosen:
                next_c = np.int64(0)
                next_s += 1
                if next_s == n_slots:
                    next_s = np.int64(0)
                    next_ex += 1
        else:
            unit = lo + i
            ex = _divide(unit, per_ex, per_ex_inverse)
            rest = unit - ex * per_ex
            s = _divide(rest, n_chosen, chosen_inverse)
            tok = chosen[rest - s * n_chosen]
            slot = slots[s]
        first = ex_vector[ex] + tok
        if n_stacked != 0:  # every stacked slot: the unit's own slot is not read
            for k in range(n_stacked):
                flat[u, k] = first + stack_offsets[k]
        else:
            flat[u, 0] = first + slot_vector[slot]
            layer_out[u] = slot_layer[slot]
        ex_out[u] = examples[ex]
        tok_out[u] = tok
        if has_labels:
            label_out[u] = labels[ex * tokens_per_ex + tok]
