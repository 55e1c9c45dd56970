"""dump.plan: the batches of a dump sit on a fixed grid inside each shard, however the work is
split between writers or resumed."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from saev_shards.dump.plan import batches


def tiles(pieces: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether ``pieces`` cover ``[lo, hi)`` in order, without gaps or empty pieces."""
    edges = [lo, *(b for _, b in pieces)]
    return all(a == e and b > a for (a, b), e in zip(pieces, edges, strict=False)) and edges[-1] == hi


@given(
    n=st.integers(0, 200),
    per_shard=st.integers(1, 40),
    batch=st.integers(1, 50),
    cuts=st.lists(st.integers(0, 200), max_size=4),
)
def test_batches_sit_on_one_grid_whatever_the_split(n: int, per_shard: int, batch: int, cuts: list[int]) -> None:
    whole = list(batches(0, n, per_shard, batch))
    assert tiles(whole, 0, n)
    for a, b in whole:
        assert b - a <= batch
        assert a // per_shard == (b - 1) // per_shard  # never across a shard boundary
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    for lo, hi in itertools.pairwise(bounds):
        split = list(batches(lo, hi, per_shard, batch))
        assert tiles(split, lo, hi)
        # each batch of a part is inside one batch of the whole run: the same grid
        assert all(any(a0 <= a and b <= b0 for a0, b0 in whole) for a, b in split)
