"""The threads an epoch on the host works with, kept from one epoch to the next (`Pools`), and
the tasks one epoch gives them (`Tasks`)."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

from .outputs import Recycler
from .schedule import Config


class Pools:
    """What a loader lends each of its host epochs in turn: its read and gather threads, and the
    output arrays its batches are gathered into (`Recycler`).

    Both used to be made for every epoch. Starting a thread waits until it has taken the GIL
    once to say so; on a busy machine, with the previous thread already running Python, that
    took 1-2 ms a thread, so the six threads of an epoch (4 read, 2 gather on 2 cores) cost
    6-12 ms before its first batch. And every epoch's outputs were fresh memory, whose pages
    the kernel zeroes on first touch: 44 MB of 4,096-row batches per epoch (7 in flight), 175
    MB of 16,384-row ones, about as much work as gathering them. On the page-cached benchmark's
    quick cache (0.36 GB: an epoch is ~50 ms) the two took a fifth of the time (docs/loaders.md,
    "Speed"). Idle threads hold nothing of the epoch that used them; the arrays are the same
    memory an epoch holds while it runs. Only the process that made the threads may use them (a
    forked child has none of them).
    """

    def __init__(self, cfg: Config) -> None:
        self.pid = os.getpid()
        self.read_threads, self.gather_threads = cfg.read_threads, cfg.gather_threads
        self.read = ThreadPoolExecutor(max_workers=cfg.read_threads, thread_name_prefix="saev-loader-read")
        self.gather = ThreadPoolExecutor(max_workers=cfg.gather_threads, thread_name_prefix="saev-loader-gather")
        self.outputs = Recycler(keep=chunks_in_flight(cfg) + 4)
        self.closed = False

    def fits(self, cfg: Config) -> bool:
        """Whether these still run, in this process, with ``cfg``'s thread counts."""
        return not self.closed and (self.pid, self.read_threads, self.gather_threads) == (
            os.getpid(),
            cfg.read_threads,
            cfg.gather_threads,
        )

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads (joined unless ``wait`` is false, this is one of them, or the garbage
        collector is running: a loader may be collected on any thread) and let go of the outputs."""
        self.closed = True
        wait = wait and joinable(self.read._threads | self.gather._threads)
        self.read.shutdown(wait=wait, cancel_futures=True)
        self.gather.shutdown(wait=wait, cancel_futures=True)
        self.outputs.arrays.clear()


_COLLECTING = threading.local()


def _collecting(phase: str, _info: dict[str, Any]) -> None:
    _COLLECTING.now = phase == "start"


gc.callbacks.append(_collecting)


def joinable(threads: AbstractSet[threading.Thread]) -> bool:
    """Whether this thread may join ``threads``: not one of them, and not inside the garbage
    collector, which may run a loader's ``__del__`` at any allocation, even one inside
    threading's own bookkeeping that holds the lock a join needs (a collected object's join
    there deadlocks). A collected loader's threads are idle, and exit once shut down."""
    return threading.current_thread() not in threads and not getattr(_COLLECTING, "now", False)


def chunks_in_flight(cfg: Config) -> int:
    """Chunks an epoch gathers ahead of the consumer: every gather thread busy, and ``prefetch``
    batches ready."""
    return cfg.gather_threads + -(-cfg.prefetch // cfg.chunk_batches)


class Tasks:
    """The tasks one epoch submits to a pool it may share: `cancel` drops those not started
    and waits for the others, as ``shutdown(wait=True, cancel_futures=True)`` does for a pool
    of its own, and leaves the pool's threads for the next epoch."""

    def __init__(self, pool: ThreadPoolExecutor, owned: bool = False) -> None:
        self.pool = pool
        self.owned = owned
        self.pending: set[Future[Any]] = set()
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``pool.submit(fn, *args)``; `CancelledError` once the pool is shut down (by its loader,
        or by the interpreter's exit, which shuts every pool down before ``atexit`` closes the
        epochs still running: a window loaded in between must not start the next)."""
        try:
            future = self.pool.submit(fn, *args)
        except RuntimeError as err:  # "cannot schedule new futures after (interpreter) shutdown"
            raise CancelledError(str(err)) from err
        with self.lock:
            self.pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        with self.lock:
            self.pending.discard(future)

    def cancel(self) -> None:
        if self.owned:
            self.pool.shutdown(wait=joinable(self.pool._threads), cancel_futures=True)
            return
        with self.lock:
            futures = list(self.pending)
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)
