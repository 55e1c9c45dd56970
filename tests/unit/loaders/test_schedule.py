"""loaders.schedule: an epoch's chunks of batches and the windows each touches, property-tested
against the plan's own segments; small batches gathered several to a chunk."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from saev_shards import loaders
from saev_shards.loaders.plan import EpochPlan, Window
from saev_shards.loaders.schedule import Epoch, Schedule

from ...support.caches import small_metadata


def plan_of(window_units: list[int], batch_size: int, drop_last: bool) -> EpochPlan:
    """A plan whose windows hold ``window_units`` units (the spans themselves do not matter here)."""
    starts = np.zeros(len(window_units) + 1, dtype=np.int64)
    np.cumsum(window_units, out=starts[1:])
    n_units = int(starts[-1])
    n_batches = n_units // batch_size if drop_last else -(-n_units // batch_size)
    windows = [Window(w, np.zeros(1, dtype=np.int64), 0, 0, n) for w, n in enumerate(window_units)]
    return EpochPlan(windows, starts, n_units, n_batches, batch_size)


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=8),
    st.integers(1, 25),
    st.integers(1, 6),
    st.booleans(),
    st.data(),
)
def test_chunks_tile_the_batches_and_know_their_windows(
    window_units: list[int], batch_size: int, chunk_batches: int, drop_last: bool, data: st.DataObject
) -> None:
    plan = plan_of(window_units, batch_size, drop_last)
    start = data.draw(st.integers(0, plan.n_batches))
    schedule = Schedule(plan, start, chunk_batches)
    # Chunks of chunk_batches batches (the last may be fewer), from batch `start` to the last.
    batches = [b for c in range(len(schedule)) for b in range(schedule.first_batch[c], schedule.stop_batch[c])]
    assert batches == list(range(start, plan.n_batches))
    assert all(0 < n <= chunk_batches for n in schedule.stop_batch - schedule.first_batch)
    readers = np.zeros(len(plan.windows) + 1, dtype=np.int64)
    for c in range(len(schedule)):
        lo, hi = int(schedule.lo[c]), int(schedule.hi[c])
        first_lo, _ = plan.batch_range(int(schedule.first_batch[c]))
        _, last_hi = plan.batch_range(int(schedule.stop_batch[c]) - 1)
        assert (lo, hi) == (first_lo, last_hi)
        touched = [w for w, _, _ in plan.segments(lo, hi)]
        assert touched == list(range(schedule.w_first[c], schedule.w_last[c] + 1))
        readers[touched] += 1
        assert schedule.n_slots >= len(touched)
    # Each window is free once the chunks that gather from it have: their count, per window.
    assert schedule.readers.tolist() == readers.tolist()
    assert schedule.n_slots >= 2


def test_an_epoch_asks_its_generator_for_each_window() -> None:
    plan = plan_of([5, 5], 2, drop_last=False)
    asked: list[tuple[int, int]] = []

    def window_rng(epoch: int, window: int) -> np.random.Generator | None:
        asked.append((epoch, window))
        return None if window else np.random.default_rng(0)

    epoch = Epoch(Schedule(plan, 0, 1), 3, window_rng)
    assert epoch.plan is plan and epoch.rng(1) is None and epoch.rng(0) is not None
    assert asked == [(3, 1), (3, 0)]


def test_small_batches_are_gathered_by_chunk(make_cache: Any) -> None:
    md = small_metadata(n_examples=23)
    shards, _ = make_cache(md)
    loader = loaders.ShuffledLoader(shards, mix_layers=True, batch_size=3, buffer_bytes=1 << 20)
    assert loader._config.chunk_batches > 1
    batches = list(loader)
    assert [len(b) for b in batches[:-1]] == [3] * (len(batches) - 1)
    # Batches of one chunk share one output array, yet a kept batch never changes (recycled only when free).
    kept = [b.acts.clone() for b in batches]
    list(loader)
    for b, k in zip(batches, kept, strict=True):
        assert torch.equal(b.acts, k)
