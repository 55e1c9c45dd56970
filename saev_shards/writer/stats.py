"""Per-shard statistics while writing: one `StatsAccumulator` per shard, in a thread of its own.

Shard ``k``'s sums go into its part record; `finalize` adds the shards' sums in shard
order and writes stats.json (protocol.md section 2.6) from the total. The accumulator
itself lives in `saev_shards.statistics`, where the store's stats sidecar uses it too.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy.typing as npt

from ..statistics import StatsAccumulator

#: Batches that may wait for the statistics thread before the writer blocks.
_STATS_BACKLOG = 2


class StatsPass:
    """The writer's statistics: one `StatsAccumulator` per shard, updated in a thread of their own.

    numpy releases the GIL, so the sums overlap the disk writes; they run in submission
    order, and at most `_STATS_BACKLOG` batches wait for them before the writer blocks.
    """

    def __init__(self, n_layers: int, d_model: int, dtype: str) -> None:
        self.n_layers, self.d_model, self.dtype = n_layers, d_model, dtype
        #: Shard -> its sums (complete once `wait_through` has passed the shard).
        self.shards: dict[int, StatsAccumulator] = {}
        self._pool = ThreadPoolExecutor(1, "saev-shards-stats")
        self._pending: collections.deque[tuple[int, Future[None]]] = collections.deque()

    def submit(
        self, k: int, acts: npt.NDArray[Any], lengths: npt.NDArray[Any] | None, scales: npt.NDArray[Any] | None = None
    ) -> None:
        """Add ``acts`` (examples of shard ``k``, with their scales for float8_e4m3) in the background."""
        stats = self.shards.setdefault(k, StatsAccumulator(self.n_layers, self.d_model))
        self._pending.append((k, self._pool.submit(stats.update, acts, self.dtype, lengths, scales)))
        while len(self._pending) > _STATS_BACKLOG:
            self._pending.popleft()[1].result()

    def wait_through(self, k: int) -> None:
        """Wait until every batch of shards up to ``k`` is summed."""
        while self._pending and self._pending[0][0] <= k:
            self._pending.popleft()[1].result()

    def shutdown(self, cancel: bool = False) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)
