"""loaders.pools: the threads a host epoch works with, kept from one epoch to the next: the
gathers run on the gather pool, never the consumer's thread; an epoch's threads and outputs
serve the next, in this process only; no join inside the garbage collector."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import numpy as np
import pytest

from saev_shards import loaders
from saev_shards.loaders import host_run, pools, schedule

from ...support.caches import expected_vectors, small_metadata
from ...support.loaders import check_batch

# These tests check every token of every layer once: on their caches of two layers a batch
# mixes layers on purpose (the loaders refuse that unless told: test_mixed_layers_are_refused).


def ShuffledLoader(*args: Any, **kwargs: Any) -> loaders.ShuffledLoader:
    return loaders.ShuffledLoader(*args, mix_layers=True, **kwargs)


def test_gathers_run_on_the_gather_pool_not_the_consumer(make_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gather runs on a ``saev-loader-gather`` thread, several of them, never the training loop's."""
    md = small_metadata(n_examples=400, patches_per_shard=400)
    shards, logical = make_cache(md, batches=(100,))
    threads: list[str] = []
    real_take: Any = np.take
    barrier = threading.Barrier(2, timeout=5)

    def take(a: Any, indices: Any, axis: Any = None, out: Any = None, mode: str = "raise") -> Any:
        if out is not None:  # a batch gather (planning never gathers into an out array)
            threads.append(threading.current_thread().name)
            if len(threads) <= 2:
                barrier.wait()  # the first two gathers run at the same time, on two threads
        return real_take(a, indices, axis=axis, out=out, mode=mode)

    monkeypatch.setattr(np, "take", take)  # the module object the pipeline calls through
    monkeypatch.setattr(schedule, "CHUNK_BYTES", 1)  # one batch per task, as with real-sized rows
    loader = ShuffledLoader(shards, batch_size=1000, gather_threads=3, buffer_bytes=100_000, block_bytes=4000)
    seen = []
    for b in loader:
        seen += check_batch(b, md, logical)
    assert sorted(seen) == sorted(expected_vectors(md))
    assert len(threads) >= len(loader)
    assert all(name.startswith("saev-loader-gather") for name in threads), set(threads)
    assert len(set(threads)) >= 2


def test_threads_and_outputs_are_kept_from_one_epoch_to_the_next(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch's threads and output arrays serve the next (`pools.Pools`), in this process only."""
    md = small_metadata(n_examples=200, patches_per_shard=400)
    shards, logical = make_cache(md, batches=(50,))
    loader = ShuffledLoader(shards, batch_size=64, buffer_bytes=100_000, block_bytes=4000)
    epochs = []
    for _ in range(2):
        seen = []
        for b in loader:
            seen += check_batch(b, md, logical)
        assert sorted(seen) == sorted(expected_vectors(md))
        pools = loader._spares.pools
        assert pools is not None
        epochs.append((pools, set(pools.read._threads | pools.gather._threads), {id(a) for a in pools.outputs.arrays}))
    (first, threads, outputs), (second, threads2, outputs2) = epochs
    # The first epoch's threads serve the second (a pool starts its threads lazily, so a busy
    # second epoch may add some, up to the pools' sizes), and so do its output arrays.
    cfg = loader._config
    assert second is first and threads <= threads2 and outputs & outputs2
    assert len(threads2) <= cfg.read_threads + cfg.gather_threads
    # A forked child has none of its parent's threads: it makes its own.
    monkeypatch.setattr(os, "getpid", lambda: -1)
    assert len(list(loader)) == len(loader)
    assert loader._spares.pools is not first and first.closed
    monkeypatch.undo()
    loader.close()
    assert first.read._shutdown and first.gather._shutdown


def test_no_join_inside_the_garbage_collector() -> None:
    """A loader collected by the cycle collector (which may run inside threading's own
    bookkeeping, holding the lock a join needs) never joins threads there: it only asks."""
    seen: list[bool] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            seen.append(pools.joinable(set()))

    Cycle()
    gc.collect()
    assert seen == [False]
    assert pools.joinable(set())  # outside the collector a join is fine
    assert not pools.joinable({threading.current_thread()})  # never this thread itself


def test_a_task_for_a_shut_down_pool_is_cancelled_not_a_runtime_error() -> None:
    """At the interpreter's exit every pool is shut down before ``atexit`` closes the epochs still
    running; a task submitted in between (a window's load finishing starts the next) is a
    `CancelledError` for the run to stop on, not a RuntimeError printed from a callback."""
    from concurrent.futures import CancelledError, ThreadPoolExecutor

    executor = ThreadPoolExecutor(1)
    tasks = pools.Tasks(executor)
    assert tasks.submit(lambda: 7).result() == 7
    executor.shutdown(wait=True)
    with pytest.raises(CancelledError, match="after shutdown"):
        tasks.submit(lambda: 7)


def test_an_iterator_left_open_at_exit_stops_without_noise(make_cache: Any) -> None:
    """The first window's load, finished after its pools were shut down (as the interpreter's
    exit does), starts nothing and raises nothing in its callback; closing the run still works."""
    from concurrent.futures import Future

    md = small_metadata(n_examples=400, patches_per_shard=100)
    shards, logical = make_cache(md, batches=(50,))
    loader = ShuffledLoader(shards, batch_size=64, buffer_bytes=20_000, block_bytes=4000)
    it = iter(loader)
    check_batch(next(it), md, logical)
    (run,) = list(loader._runs)
    assert isinstance(run, host_run.HostRun)
    run.pools.read.shutdown(wait=True)
    run.pools.gather.shutdown(wait=True)
    with run.lock:  # as if the last window had not been submitted yet, its slot free
        run.next_load = run.release_below = int(run.schedule.w_last[-1])
        first: Future[Any] = Future()
        first.set_result(None)
        run.first_load = first
    run._first_loaded(run.first_load)  # the callback a finished first load runs: no RuntimeError
    loader.close()
    assert run.closed
