"""loaders.outputs: stored values cast into the caller's dtype as torch casts them, bit for bit;
output arrays reused once nothing outside refers to them, never while a batch holds one."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from saev_shards.loaders import outputs
from saev_shards.loaders.outputs import Recycler
from saev_shards.loaders.tensors import torch_dtype

finite_or_not = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-40, -1e-45, 65504.0, 7e4])
)


@given(
    hnp.arrays(np.float32, st.integers(0, 64), elements=finite_or_not),
    st.sampled_from(["float16", "bfloat16", "float32"]),
    st.sampled_from(["float16", "bfloat16", "float32"]),
)
def test_cast_into_matches_torch(values: np.ndarray[Any, Any], stored: str, out: str) -> None:
    """The gather threads cast with numpy; the result is torch's cast, bit for bit (NaN as NaN)."""
    source = torch.from_numpy(values).to(torch_dtype(stored))
    raw = source.view(torch.int16).numpy().view(np.uint16) if stored == "bfloat16" else source.numpy()
    want = source.to(torch_dtype(out))
    dest = torch.empty(len(values), dtype=torch_dtype(out))
    view = dest.view(torch.int16).numpy().view(np.uint16) if out == "bfloat16" else dest.numpy()
    outputs.cast_into(raw, stored, out, view)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(dest), nan)
    assert torch.equal(dest[~nan], want[~nan])


def test_an_array_is_reused_only_once_nothing_else_refers_to_it() -> None:
    recycler = Recycler(keep=2)
    f32 = np.dtype(np.float32)
    held = torch.from_numpy(recycler.get((4, 3), f32))  # a batch's tensor keeps its array
    first = id(recycler.arrays[0])
    assert id(recycler.get((4, 3), f32)) != first  # held: another array, let go of at once
    second = id(recycler.arrays[1])
    assert id(recycler.get((4, 3), f32)) == second  # free: reused, not made
    del held
    assert id(recycler.get((4, 3), f32)) == first
    assert [id(x) for x in recycler.arrays] == [second, first]  # most recently used last


def test_an_array_of_another_shape_is_dropped_and_at_most_keep_are_kept() -> None:
    recycler = Recycler(keep=2)
    recycler.get((4,), np.dtype(np.float16))
    other = recycler.get((5,), np.dtype(np.float16))  # the free one is of another size: made anew
    assert other.shape == (5,) and len(recycler.arrays) == 1
    held = [recycler.get((5,), np.dtype(np.float16)) for _ in range(3)]
    assert len({id(x) for x in [other, *held]}) == 4 and len(recycler.arrays) == 2
