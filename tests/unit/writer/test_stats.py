"""writer.stats: the per-shard statistics summed in threads are the bits one thread gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.statistics import StatsAccumulator
from saev_shards.writer import stats


@given(
    batches=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    threads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_threaded_sums_are_the_single_thread_sums(batches: list[int], threads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    acts = [rng.standard_normal((n, 2, 3, 4)).astype(np.float16) for n in batches]
    lengths = [rng.integers(0, 4, n) for n in batches]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats, "_STATS_THREADS", threads)
        sums = stats.StatsPass(2, 4, "float16")
        assert sums.threads == threads
        for k, (a, n) in enumerate(zip(acts, lengths, strict=True)):
            sums.submit(k // 2, a, n)  # two batches a shard
        sums.wait_through(len(batches))
        sums.shutdown()
    for k in range(-(-len(batches) // 2)):
        one = StatsAccumulator(2, 4)
        for a, n in list(zip(acts, lengths, strict=True))[2 * k : 2 * k + 2]:
            one.update(a, "float16", n)
        assert sums.shards[k].to_json() == one.to_json()


def test_wait_through_leaves_later_shards_pending() -> None:
    sums = stats.StatsPass(1, 2, "float32")
    ones = np.ones((3, 1, 2, 2), np.float32)
    sums.submit(0, ones, None)
    sums.submit(1, ones, None)
    sums.wait_through(0)
    assert sums.shards[0].count.tolist() == [6]
    assert sums.shards[1].count.tolist() == [0]  # submitted, not yet added
    sums.wait_through(1)
    assert sums.shards[1].count.tolist() == [6]
    sums.shutdown()
