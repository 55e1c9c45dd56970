"""The torch side of the loaders: dtype names, wrapping stored values, pinned allocations.

torch is imported inside each function, so importing this module needs numpy alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..codecs import dtypes
from ..optional import require
from ..protocol.common import FLOAT8
from ..protocol.float8 import FLOAT8_DTYPE

if TYPE_CHECKING:
    import torch


def require_torch(what: str) -> None:
    """`MissingDependencyError` saying how to install the ``torch`` extra when torch is
    missing: the loaders are the one part of reading that needs it (``what`` names the class)."""
    require("torch", "torch", what)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``."""
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def to_tensor(raw: npt.NDArray[Any], stored: str, out: str, scales: npt.NDArray[Any] | None = None) -> torch.Tensor:
    """Wrap stored values (bfloat16 as raw uint16) in a tensor of dtype ``out``; float8_e4m3
    values are dequantized with their ``scales`` (one per vector) first.

    ``raw`` must be a fresh writable array; when no cast is needed the tensor shares it.
    """
    import torch

    if stored == FLOAT8:
        if scales is None:
            raise ValueError("float8_e4m3 values need their scales")
        values = dtypes.convert(raw, FLOAT8, out, scales)
        return to_tensor(values, out, out)
    if stored == "bfloat16":
        tensor = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(raw)
    return tensor if stored == out else tensor.to(torch_dtype(out))


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in page-locked host memory: the loaders' one pinned allocation.

    torch's caching host allocator recycles the block once the tensor is freed *and* every
    ``non_blocking`` copy that read it has finished (it records an event per copy).
    """
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=True)


def as_numpy(tensor: torch.Tensor, stored: str) -> npt.NDArray[Any]:
    """The numpy array sharing ``tensor``'s memory, in the stored numpy dtype (bfloat16 as uint16;
    float8_e4m3, held as uint8 bytes in torch, as ml_dtypes' float8_e4m3fn)."""
    import torch

    if stored == FLOAT8:
        return tensor.view(torch.uint8).numpy().view(FLOAT8_DTYPE)
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
