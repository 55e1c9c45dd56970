"""Stored values to the dtypes they are read as, activations to the stored dtypes, and
non-finite checks by bits.

bfloat16 is stored as its raw 2 bytes and held by numpy as uint16 (`bfloat16`). Casts round to
nearest, ties to even, exactly as torch does, so a cache is byte-identical whether it was
written from numpy or from torch tensors. float8_e4m3 is quantized with a scale per vector
(`saev_shards.codecs.float8`), not cast.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

from ..protocol.common import DTYPES, FLOAT8
from . import float8
from .bfloat16 import bf16_to_float32, float32_to_bf16

#: Bits that are all set exactly when a value is inf or NaN, per stored dtype (E4M3 has no
#: infinity: 0x7F and 0xFF are its NaNs).
_EXPONENT_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, FLOAT8: 0x7F}
_UINT_VIEW = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32, FLOAT8: np.uint8}
#: Elements per step of the chunked non-finite scan: small enough to stay in L2 cache.
_SCAN_CHUNK = 1 << 17


def is_torch_tensor(x: object) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_float32(raw: npt.NDArray[Any], dtype: str, scales: npt.NDArray[Any] | None = None) -> npt.NDArray[np.float32]:
    """Stored values of ``dtype`` (as read from a cache) to float32; float8_e4m3 values are
    dequantized with their ``scales`` (one per vector, shape ``raw.shape[:-1]``)."""
    if dtype == "bfloat16":
        return bf16_to_float32(raw)
    if dtype == FLOAT8:
        if scales is None:
            raise ValueError("float8_e4m3 values need their scales to be read")
        return float8.dequantize(raw, scales, "float32")
    return np.asarray(raw, dtype=np.float32)


#: The dtypes values can be read as, by name (bfloat16 as its raw uint16 bits, as it is stored).
READ_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),
}


def convert(
    raw: npt.NDArray[Any],
    stored: str,
    dtype: str,
    scales: npt.NDArray[Any] | None = None,
    out: npt.NDArray[Any] | None = None,
    *,
    elementwise: bool = False,
) -> npt.NDArray[Any]:
    """Stored values of ``stored`` as ``dtype`` (one of `READ_DTYPES`), into ``out`` when given:
    dequantized for float8_e4m3 (`float8.dequantize`, with the ``scales`` of its vectors, shape
    ``raw.shape[:-1]``, or with ``elementwise`` each value's vector's scale in ``raw``'s shape;
    `DtypeRangeError` when float16 cannot hold them), cast otherwise (rounding to nearest, ties
    to even). Without ``out``, ``raw`` itself when it already is ``dtype``, else a fresh array."""
    if stored == FLOAT8:
        if scales is None:
            raise ValueError("float8_e4m3 values need their scales to be read")
        if elementwise:
            converted = float8.dequantize_elementwise(raw, scales, dtype)
        elif out is not None and out.flags.c_contiguous and out.dtype == READ_DTYPES.get(dtype):
            return float8.dequantize(raw, scales, dtype, out)  # straight into the caller's array
        else:
            converted = float8.dequantize(raw, scales, dtype)
    elif stored == dtype:
        converted = raw
    else:
        wide_values = to_float32(raw, stored)
        if dtype == "bfloat16":
            converted = float32_to_bf16(wide_values)
        else:
            with np.errstate(over="ignore"):  # beyond float16's range is inf, as a cast always gives
                converted = wide_values.astype(DTYPES[dtype])
    if out is None:
        return converted
    out[...] = converted
    return out


def to_stored(x: object, dtype: str) -> tuple[npt.NDArray[Any], bool]:
    """Cast activations (numpy array or torch tensor) to the stored dtype ``dtype``.

    Returns ``(array, owned)``: a C-contiguous little-endian array with `DTYPES[dtype]`,
    and whether it is a fresh buffer (False when it may share memory with ``x``).
    Raises `TypeError` for non-floating input.
    """
    target = DTYPES[dtype]
    if is_torch_tensor(x):
        return _torch_to_stored(x, dtype)
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise TypeError(f"expected floating-point activations, found dtype {arr.dtype}")
    if dtype == "bfloat16":
        return float32_to_bf16(arr), True
    if arr.dtype == target and arr.flags.c_contiguous:
        return arr, False
    torch = sys.modules.get("torch")
    if torch is not None and arr.dtype in (np.float32, np.float64) and arr.flags.c_contiguous:
        # numpy's float->float16 cast is scalar code (~0.4 GB/s here); torch's is
        # vectorised and rounds identically. Only used when torch is already imported.
        if arr.flags.writeable:
            tensor = torch.from_numpy(arr)
        else:
            # A read-only array (a memmap slice): torch warns that it cannot protect it. The
            # cast below only reads it, so wrap it without the warning, and without a copy.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensor = torch.from_numpy(arr)
        out = tensor.to(torch.float16 if dtype == "float16" else torch.float32)
        return out.numpy(), True
    with np.errstate(over="ignore"):  # overflow to inf is reported by the writer's own check
        return np.ascontiguousarray(arr, dtype=target), True


def _torch_to_stored(x: Any, dtype: str) -> tuple[npt.NDArray[Any], bool]:
    import torch

    if not x.is_floating_point():
        raise TypeError(f"expected floating-point activations, found dtype {x.dtype}")
    want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    t = x.detach()
    owned = t.dtype != want or t.device.type != "cpu" or not t.is_contiguous()
    # Cast on the tensor's own device, before the copy to host: half the bytes cross.
    t = t.to(want).contiguous().cpu()
    if dtype == "bfloat16":
        arr = t.view(torch.int16).numpy().view(np.uint16)
    else:
        arr = t.numpy()
    return arr, owned


def nonfinite_mask_any(arr: npt.NDArray[Any], dtype: str) -> bool:
    """True if any stored value is inf or NaN (a fast chunked scan of the bit patterns)."""
    mask = _EXPONENT_MASK[dtype]
    flat = arr.reshape(-1).view(_UINT_VIEW[dtype])
    tmp = np.empty(min(_SCAN_CHUNK, flat.size), dtype=flat.dtype)
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start : start + _SCAN_CHUNK]
        out = tmp[: chunk.size]
        np.bitwise_and(chunk, mask, out=out)
        if out.max() == mask:
            return True
    return False


def nonfinite_elements(arr: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.bool_]:
    """Boolean mask of inf/NaN elements, same shape as ``arr``."""
    mask = _EXPONENT_MASK[dtype]
    bits = arr.view(_UINT_VIEW[dtype])
    result: npt.NDArray[np.bool_] = (bits & mask) == mask
    return result
