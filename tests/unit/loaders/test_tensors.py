"""loaders.tensors: stored values wrapped as tensors of the dtype asked (bfloat16 from its raw
bits, float8_e4m3 dequantized with its scales), sharing memory when no cast is needed; a
tensor's memory seen by numpy in the stored dtype; torch missing said with how to install it."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.codecs import float8
from saev_shards.codecs.bfloat16 import float32_to_bf16
from saev_shards.errors import MissingDependencyError
from saev_shards.loaders.tensors import as_numpy, require_torch, to_tensor, torch_dtype

DTYPES = ["float16", "bfloat16", "float32"]
values = hnp.arrays(np.float32, st.integers(0, 24), elements=st.floats(-60000, 60000, width=32))


def test_dtype_names() -> None:
    assert [torch_dtype(n) for n in DTYPES] == [torch.float16, torch.bfloat16, torch.float32]
    with pytest.raises(KeyError):
        torch_dtype("float64")


def stored_as(x: np.ndarray[Any, Any], stored: str) -> np.ndarray[Any, Any]:
    return float32_to_bf16(x) if stored == "bfloat16" else x.astype(stored)


@given(values, st.sampled_from(DTYPES), st.sampled_from(DTYPES))
def test_stored_values_become_the_dtype_asked(x: np.ndarray[Any, Any], stored: str, out: str) -> None:
    raw = stored_as(x, stored)
    tensor = to_tensor(raw.copy(), stored, out)
    want = torch.from_numpy(x).to(torch_dtype(stored)).to(torch_dtype(out))
    assert tensor.dtype == torch_dtype(out) and torch.equal(tensor, want)
    if stored == out and len(x):  # no cast: the tensor is the array's memory, seen back in the stored dtype
        fresh = raw.copy()
        shared = to_tensor(fresh, stored, out)
        view = as_numpy(shared, stored)
        assert view.dtype == fresh.dtype and np.shares_memory(view, fresh)


def test_float8_values_are_dequantized_with_their_scales() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 16)) * 3).astype(np.float32)
    q, s = float8.quantize_numpy(x)
    for out in DTYPES:
        tensor = to_tensor(q.copy(), "float8_e4m3", out, s)
        want = float8.dequantize(q, s, out)
        got = as_numpy(tensor, out)
        assert tensor.dtype == torch_dtype(out) and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="float8_e4m3 values need their scales"):
        to_tensor(q.copy(), "float8_e4m3", "float32")
    held = torch.from_numpy(q.view(np.uint8).copy())
    assert as_numpy(held, "float8_e4m3").dtype == float8.FLOAT8_DTYPE


def test_torch_missing_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    require_torch("TokenLoader")  # installed here
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match=r"TokenLoader needs torch, which is not installed.*pip install"):
        require_torch("TokenLoader")
