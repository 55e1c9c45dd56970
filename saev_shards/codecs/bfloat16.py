"""bfloat16 as numpy holds it: its raw 2 bytes (the upper half of a float32) as uint16, since
numpy has no bfloat16 (protocol.md 5). Rounding to it is to nearest, ties to even, exactly as
torch does, so a cache is byte-identical whether it was written from numpy or from torch
tensors; widening is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def float32_to_bf16(x: npt.NDArray[Any]) -> npt.NDArray[np.uint16]:
    """Round float values to bfloat16 (nearest, ties to even; NaN -> 0x7FC0), as raw uint16."""
    f = np.array(x, dtype=np.float32, order="C")  # a copy: the rounding works in it
    rounded = np.empty(f.shape, np.uint16)
    round_bfloat16(f, rounded)
    return rounded


def bf16_to_float32(raw: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Widen raw bfloat16 bits (uint16) to float32 exactly."""
    return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


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
