"""Per-shard statistics while writing: one `StatsAccumulator` per shard, summed in threads of their own.

Shard ``k``'s sums go into its part record; `finalize` adds the shards' sums in shard
order and writes stats.json (protocol.md section 2.6) from the total. The accumulator
itself lives in `saev_shards.statistics`, where the store's stats sidecar uses it too.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy.typing as npt

from ..statistics import STATS_CHUNK, ExampleSums, StatsAccumulator, example_sums

#: Batches that may wait for the statistics threads before the writer blocks.
_STATS_BACKLOG = 2
#: Threads summing the examples of a batch, each a contiguous share of them: one on a small
#: machine, where the model (or the writer's caller) keeps the cores busy anyway; up to 4 on
#: a GPU node, whose CPU work (tokenizer, statistics, writing) paces a fast model.
_STATS_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4 if hasattr(os, "sched_getaffinity") else 1))


class StatsPass:
    """The writer's statistics: one `StatsAccumulator` per shard, summed in threads of their own.

    Each batch's examples are summed in up to `_STATS_THREADS` threads, a contiguous share
    each (`example_sums`; numpy releases the GIL, so the sums overlap the disk writes and
    each other); their sums go into the shard's totals in example order when the writer
    takes them (`add_sums`), so the totals are the bits a single thread gives. At most
    `_STATS_BACKLOG` batches wait before the writer blocks.
    """

    def __init__(self, n_layers: int, d_model: int, dtype: str, *, background: bool = True) -> None:
        self.n_layers, self.d_model, self.dtype = n_layers, d_model, dtype
        #: Shard -> its sums (complete once `wait_through` has passed the shard).
        self.shards: dict[int, StatsAccumulator] = {}
        #: Without ``background`` the sums are computed by the caller, in `submit`.
        self.threads = _STATS_THREADS if background else 1
        self._pool = ThreadPoolExecutor(self.threads, "saev-shards-stats") if background else None
        self._pending: collections.deque[tuple[int, list[Future[list[ExampleSums]]]]] = collections.deque()

    def submit(
        self, k: int, acts: npt.NDArray[Any], lengths: npt.NDArray[Any] | None, scales: npt.NDArray[Any] | None = None
    ) -> None:
        """Add ``acts`` (examples of shard ``k``, with their scales for float8_e4m3) in the background."""
        self.shards.setdefault(k, StatsAccumulator(self.n_layers, self.d_model))
        n = len(acts)
        step = max(STATS_CHUNK, -(-n // self.threads))
        jobs = [
            self._sums(
                acts[a : a + step],
                None if lengths is None else lengths[a : a + step],
                None if scales is None else scales[a : a + step],
            )
            for a in range(0, n, step)
        ]
        self._pending.append((k, jobs))
        while len(self._pending) > _STATS_BACKLOG:
            self._add_oldest()

    def _sums(
        self, acts: npt.NDArray[Any], lengths: npt.NDArray[Any] | None, scales: npt.NDArray[Any] | None
    ) -> Future[list[ExampleSums]]:
        if self._pool is not None:
            return self._pool.submit(example_sums, acts, self.dtype, lengths, scales)
        done: Future[list[ExampleSums]] = Future()
        done.set_result(example_sums(acts, self.dtype, lengths, scales))
        return done

    def _add_oldest(self) -> None:
        k, jobs = self._pending.popleft()
        for job in jobs:
            self.shards[k].add_sums(job.result())

    def wait_through(self, k: int) -> None:
        """Wait until every batch of shards up to ``k`` is summed."""
        while self._pending and self._pending[0][0] <= k:
            self._add_oldest()

    def shutdown(self, cancel: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
