"""The next epoch's first window indexed while the epoch before ends (`IndexAhead`).

An epoch's first batch waits for its first window's index (its permutation and the batches'
metadata: 40-70 ms for a 1 GiB window on the 2-core development machine) while the gather
threads have nothing to do. When a host epoch starts loading its last window (`HostRun`), the
loader queues the next epoch's plan and the index of its first window on a read thread, to be
computed once that load is done, beside the last window's gathers; the next epoch, if it is
that one and starts from its first batch, takes them instead of computing them again
(`TokenLoader._iterate`). The index is a pure function of the seed, the epoch, the window and
the cache's mapping, so the batches are the same either way. Only windows read in place use it
(the index points into the cache mapped in place: `mapped.CacheMap.source`); an epoch that does
not match (another epoch asked for, a resumed state, the map made again) drops it.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .mapped import CacheMap
from .plan import EpochPlan, WindowIndex, index_window

if TYPE_CHECKING:
    from .token_loader import TokenLoader

#: The next epoch's plan and the index of its first window, read in place.
Ahead = tuple[EpochPlan, WindowIndex]


class IndexAhead:
    """At most one epoch's first window, indexed ahead on a read thread (module docstring)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._mapped: CacheMap | None = None
        self._future: Future[Ahead] | None = None

    def _check_pid(self) -> None:
        """In a forked child, forget the parent's work: its threads are not here to finish it,
        and its locks may have been held when the process forked."""
        if self._pid != os.getpid():
            self._reset()

    def queue(self, loader: TokenLoader, epoch: int, pool: ThreadPoolExecutor, last_load: Future[Any]) -> None:
        """Epoch ``epoch``'s plan and the index of its first window in the cache ``loader`` maps in
        place, on ``pool`` once ``last_load`` (the epoch before's last window) is done, for the
        loader to `take` if that epoch comes next (`schedule.Epoch.after_last_load`); nothing if
        the cache is not mapped or the pool is shut down."""
        mapped = loader._config.mapped
        if mapped is None:
            return

        def work() -> Ahead:
            last_load.result()  # after the last window's load (its failure: nothing computed)
            plan = loader.plan(epoch)
            rng = loader._window_rng(epoch, 0)
            return plan, index_window(loader.selection, loader._spans, plan.windows[0], rng, mapped.source)

        old, _, _ = self._pop()
        try:
            future = pool.submit(work)
        except RuntimeError:  # the loader is closing: its threads take no new work
            future = None
        with self._lock:
            if future is not None:
                self._epoch, self._mapped, self._future = epoch, mapped, future
        if old is not None:
            old.cancel()

    def _pop(self) -> tuple[Future[Ahead] | None, int | None, CacheMap | None]:
        """Let go of what is held (in a forked child, of the parent's too): its future, epoch and map."""
        self._check_pid()
        with self._lock:
            held = self._future, self._epoch, self._mapped
            self._future, self._epoch, self._mapped = None, None, None
        return held

    def take(self, epoch: int, mapped: CacheMap | None) -> Ahead | None:
        """What was computed for epoch ``epoch`` in ``mapped``, waiting for it if it is still
        under way (queued behind the last window's load, or computing: the epoch would wait as
        long to compute it itself); None (and it is dropped) for any other epoch or map, or if it
        failed or was cancelled (the epoch then computes its own, as it always did). Called from
        the consumer's thread, never from a read thread the work may be queued for."""
        future, held_epoch, held_map = self._pop()
        if future is None:
            return None
        if held_epoch != epoch or mapped is None or held_map is not mapped:
            future.cancel()
            return None
        concurrent.futures.wait([future])
        if future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    def clear(self) -> None:
        """Drop what is held or under way (the loader is closing)."""
        future, _, _ = self._pop()
        if future is not None:
            future.cancel()
