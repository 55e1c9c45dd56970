"""The threads of one epoch on the host: windows read by a pool, batches gathered by another.

Work is cut so that every thread spends its time in large numpy calls that release the
GIL, and the consumer's thread (the training loop) does almost nothing:

* **Reads.** A window's blocks are read by ``read_threads`` threads, a few blocks per task,
  into one of a few *slot* buffers (two, unless one batch spans more windows). The
  window's index (its permutation and the batches' metadata) is computed beside them. A
  window the page cache already holds, of a local cache, is not copied: the gathers read it
  in place through one mapping of the whole cache (`mapped`), and its "read" only checks and
  maps its pages. From a remote cache the whole window is announced first
  (`Shards.prefetch`), so its blocks are fetched with many requests in flight while the
  read threads copy what has arrived.
* **Gathers.** A *chunk* (one batch, or several small ones: at least `CHUNK_BYTES`) is one
  task of the gather pool: one ``numpy.take`` per window it touches, straight into the
  output array, then its metadata sliced from the window's index. Chunks are gathered in
  parallel, so adding threads adds whole chunks in flight, never a finer split of one.
* **Scheduling** is driven by completions: once every gather has taken its rows of a window,
  the window is released and the next loads start into the freed slots; more chunks are
  submitted as windows load (``gather_threads + prefetch`` batches not yet consumed, at
  most). The consumer only pops finished chunks in order: a few microseconds of Python per
  batch.

Before this design, one assembler thread cut every batch into ``gather_threads`` parts
(at most 4 of 1,024 rows), waited for all of them, then built the batch's metadata and
queued it: per batch a fork-join, three thread hand-offs and ~0.1 ms of Python on one
thread, none of which shrinks with more threads; that serial part and the GIL hand-offs
it needs are why throughput fell past 4 threads (docs/loaders.md, "Threads").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs import float8
from ..protocol.common import FLOAT8
from ..reader import Shards
from .batch import Batch
from .mapped import CacheMap
from .outputs import Recycler, cast_into
from .plan import Blocks, EpochPlan, WindowIndex, index_window
from .selection import TokenSelection
from .tensors import as_numpy, pinned_empty, to_tensor, torch_dtype

#: Smallest output of one gather task: below this the Python around a ``numpy.take`` costs
#: more than the copy, so small batches are gathered several per task.
CHUNK_BYTES = 4 << 20


class Config:
    """Everything a running epoch needs; holds no reference to the loader object."""

    def __init__(
        self,
        shards: Shards,
        selection: TokenSelection,
        blocks: Blocks,
        batch_size: int,
        out_dtype: str,
        pin_memory: bool,
        read_threads: int,
        prefetch: int,
        gather_threads: int,
    ) -> None:
        self.shards = shards
        self.selection = selection
        self.blocks = blocks
        self.batch_size = batch_size
        self.out_dtype = out_dtype
        self.pin_memory = pin_memory
        self.read_threads = read_threads
        self.prefetch = prefetch
        self.gather_threads = gather_threads
        #: The cache mapped in place (`mapped.CacheMap`): windows are gathered from the page
        #: cache, not from buffers. None: windows are read into buffers.
        self.mapped: CacheMap | None = None
        md = shards.metadata
        self.tokens = md.tokens_per_ex
        self.d_model = md.d_model
        self.stored = md.dtype
        self.numpy_dtype = shards.numpy_dtype
        #: float8_e4m3: windows hold the stored bytes and a float32 scale per vector beside them,
        #: and batches are dequantized when they are assembled.
        self.float8 = md.dtype == FLOAT8
        self.stack = blocks.stack_layers
        #: Layer values of a stacked row, in the order of its ``L`` axis.
        self.layer_values = np.array(selection.layer_values, dtype=np.int64)
        #: Shape of one output row: ``(D,)``, or ``(L, D)`` stacked.
        self.row_shape: tuple[int, ...] = (selection.n_layers, md.d_model) if self.stack else (md.d_model,)
        row_bytes = md.d_model * md.itemsize * blocks.layers_per_unit
        #: Batches gathered by one task.
        self.chunk_batches = max(1, -(-CHUNK_BYTES // max(1, batch_size * row_bytes)))


# --------------------------------------------------------------------------------------
# which windows each chunk needs, and how many slots that takes


class Schedule:
    """Chunks of batches ``[start, n_batches)`` and the windows each touches."""

    def __init__(self, plan: EpochPlan, start: int, chunk_batches: int) -> None:
        self.plan = plan
        self.first_batch = np.arange(start, plan.n_batches, chunk_batches, dtype=np.int64)
        stop_batch = np.minimum(self.first_batch + chunk_batches, plan.n_batches)
        self.lo = self.first_batch * plan.batch_size
        self.hi = np.minimum(stop_batch * plan.batch_size, plan.n_units)
        self.stop_batch = stop_batch
        ws = plan.window_start
        self.w_first = np.searchsorted(ws, self.lo, side="right") - 1
        self.w_last = np.searchsorted(ws, self.hi - 1, side="right") - 1
        #: Window buffers held at once: two (one consumed while the next loads), or the most
        #: windows one chunk spans, whichever is larger.
        span = int((self.w_last - self.w_first).max()) + 1 if len(self) else 1
        self.n_slots = max(2, span)
        #: Chunks that gather from each window of the plan (a window is free once all have).
        edges = np.zeros(len(plan.windows) + 1, dtype=np.int64)
        np.add.at(edges, self.w_first, 1)
        np.add.at(edges, self.w_last + 1, -1)
        self.readers = np.cumsum(edges)  # and a 0 after the last window

    def __len__(self) -> int:
        return len(self.first_batch)


# --------------------------------------------------------------------------------------
# threads kept from one epoch to the next


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
        future = self.pool.submit(fn, *args)
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


# --------------------------------------------------------------------------------------
# reading windows


class WindowLoader:
    """Reads windows of one epoch into slot buffers on a pool of threads; computes their index.

    ``ready_to_write(slot)`` runs before a read writes into a slot (the device path waits
    there for the slot's last upload); ``finish(w, slot, index)`` runs once a window is
    read and indexed, in the thread that finished it, and its value is the window's result.
    A float8_e4m3 cache's scales are read into ``scale_buffers`` (one float32 per vector of
    the slot's buffer), beside the stored bytes. ``pool``: the loader's read threads (`Pools`),
    else a pool of its own, shut down by `close`.
    """

    def __init__(
        self,
        cfg: Config,
        plan: EpochPlan,
        epoch: int,
        window_rng: Callable[[int, int], np.random.Generator | None],
        buffers: Sequence[npt.NDArray[Any]],
        stop: threading.Event,
        ready_to_write: Callable[[int], None] = lambda slot: None,
        finish: Callable[[int, int, WindowIndex], Any] = lambda w, slot, index: index,
        scale_buffers: Sequence[npt.NDArray[np.float32]] = (),
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.epoch = epoch
        self.window_rng = window_rng
        self.buffers = buffers
        self.scale_buffers = scale_buffers
        self.stop = stop
        self.ready_to_write = ready_to_write
        self.finish = finish
        #: Whether each window loading or loaded is read in place (else into its slot's buffer).
        self.in_place: dict[int, bool] = {}
        owned = pool is None
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=cfg.read_threads, thread_name_prefix="saev-loader-read")
        self.pool = Tasks(pool, owned)

    def slot(self, w: int) -> int:
        return w % len(self.buffers)

    def submit(self, w: int) -> Future[Any]:
        """Start loading window ``w``; the future's result is ``finish(w, slot, index)``."""
        cfg = self.cfg
        window = self.plan.windows[w]
        slot = self.slot(w)
        rows = cfg.blocks.rows[window.blocks]
        # A remote cache starts fetching the whole window's blocks now, a float8_e4m3 one its scales.
        if cfg.shards.files.prefetches or cfg.float8:
            for b in window.blocks.tolist():
                cfg.shards.prefetch(int(cfg.blocks.start[b]), int(cfg.blocks.stop[b]))
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(rows[:-1], out=offsets[1:])
        # Read in place when the page cache holds the window (its blocks' first pages say so),
        # else into the slot's buffer: from disk, the copy into the buffer is the read itself.
        mapped, blocks = cfg.mapped, cfg.blocks
        position = None if blocks.whole else int(blocks.read_positions[0])
        self.in_place[w] = mapped is not None and all(
            mapped.probably_resident(int(blocks.start[b]), position) for b in window.blocks.tolist()
        )
        # The index first: it needs no data, so it is ready by the time the reads are.
        index = self.pool.submit(self._index, w)
        parts: list[Future[Any]] = [index]
        # One task per read thread, each taking the next block in window order until none is
        # left: as balanced as a task per block (no thread idles while others read the last
        # blocks of a window), with a handful of futures per window instead of one per block.
        next_block = itertools.count()
        parts += [
            self.pool.submit(self._read_blocks, slot, window.blocks, offsets, next_block, self.in_place[w])
            for _ in range(min(len(rows), cfg.read_threads))
        ]
        load = _Countdown(functools.partial(self.finish, w, slot))
        load.watch(parts)
        return load.done

    def _index(self, w: int) -> WindowIndex:
        """Window ``w``'s index; read in place, in the map's vectors, and for a cache larger than
        memory the pages of the window whose slot this one takes unmapped."""
        cfg = self.cfg
        window, rng = self.plan.windows[w], self.window_rng(self.epoch, w)
        before = w - len(self.buffers)  # the window whose slot this one takes: done with
        if cfg.mapped is not None and cfg.mapped.bounded and self.in_place.pop(before, False):
            for b in self.plan.windows[before].blocks.tolist():
                cfg.mapped.unmap_pages(int(cfg.blocks.start[b]), int(cfg.blocks.stop[b]))
        if not self.in_place[w]:
            return index_window(cfg.selection, cfg.blocks, window, rng)
        assert cfg.mapped is not None
        return index_window(cfg.selection, cfg.blocks, window, rng, cfg.mapped.source)

    def source(self, w: int) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32] | None]:
        """The arrays window ``w``'s index points into: the cache read in place, or its slot's
        buffers (values, and a float8_e4m3 cache's scales)."""
        if self.in_place[w]:
            assert self.cfg.mapped is not None
            return self.cfg.mapped.values, self.cfg.mapped.scales
        slot = self.slot(w)
        return self.buffers[slot], self.scale_buffers[slot] if self.scale_buffers else None

    def _read_blocks(
        self,
        slot: int,
        ids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        next_block: Iterator[int],
        in_place: bool = False,
    ) -> None:
        if not in_place:
            self.ready_to_write(slot)
        buffer = self.buffers[slot]
        scales = self.scale_buffers[slot] if self.scale_buffers else None
        blocks = self.cfg.blocks
        for i in next_block:  # itertools.count: its next() is atomic, each block goes to one thread
            if i >= len(ids):
                return
            if self.stop.is_set():
                raise CancelledError
            if in_place:
                assert self.cfg.mapped is not None
                start, stop = int(blocks.start[ids[i]]), int(blocks.stop[ids[i]])
                self.cfg.mapped.make_resident(start, stop, blocks, self.stop)
                self.cfg.mapped.check_scales(start, stop, blocks)  # read from the files, they are checked there
            else:
                self._read_block(int(ids[i]), buffer, int(offsets[i]), scales)

    def _read_block(
        self, block: int, buffer: npt.NDArray[Any], row_offset: int, scales: npt.NDArray[np.float32] | None
    ) -> None:
        cfg = self.cfg
        blocks = cfg.blocks
        start, stop = int(blocks.start[block]), int(blocks.stop[block])
        count = stop - start
        rows_per_ex = blocks.rows_per_ex
        first, last = row_offset * cfg.tokens, (row_offset + count * rows_per_ex) * cfg.tokens
        slices = buffer[first:last].reshape(count, rows_per_ex, cfg.tokens, cfg.d_model)
        scale_slices = None if scales is None else scales[first:last].reshape(count, rows_per_ex, cfg.tokens)
        if blocks.whole:
            cfg.shards.read_range_raw(start, stop, slices)
            if scale_slices is not None:
                cfg.shards.read_range_scales(start, stop, scale_slices)
            return
        for e in range(count):
            if self.stop.is_set():
                raise CancelledError
            for s, position in enumerate(blocks.read_positions.tolist()):
                cfg.shards.read_example_raw(start + e, position, slices[e, s])
                if scale_slices is not None:
                    cfg.shards.read_example_scales(start + e, position, scale_slices[e, s])

    def close(self) -> None:
        self.stop.set()
        self.pool.cancel()
        # Nothing of this epoch outlives it: the caller's callbacks may refer back to its run.
        self.buffers = ()
        self.ready_to_write = self.finish = _closed


def _closed(*_: Any) -> Any:
    raise CancelledError


class _Countdown:
    """``done`` resolves to ``finish(result of the first part)`` once every part has finished
    (or fails with the first part's failure).

    The parts' callbacks refer to this object, so it lets go of the parts and of ``finish``
    once it resolves: no reference cycle keeps a window's arrays alive until the garbage
    collector runs (a run's window buffers and output arrays used to stay allocated until
    then, so every new loader touched fresh memory: docs/loaders.md, "Read-ahead").
    """

    def __init__(self, finish: Callable[[Any], Any]) -> None:
        self.done: Future[Any] = Future()
        self.finish: Callable[[Any], Any] | None = finish
        self.parts: list[Future[Any]] = []
        self.remaining = 0
        self.lock = threading.Lock()

    def watch(self, parts: list[Future[Any]]) -> None:
        self.parts = parts
        self.remaining = len(parts)
        for part in parts:
            part.add_done_callback(self._part_done)

    def _part_done(self, _: Future[Any]) -> None:
        with self.lock:
            self.remaining -= 1
            if self.remaining:
                return
        parts, finish = self.parts, self.finish
        self.parts, self.finish = [], None
        assert finish is not None
        try:
            for part in parts:
                part.result()  # the first failure (or cancellation) is the window's
            self.done.set_result(finish(parts[0].result()))
        except BaseException as err:
            self.done.set_exception(err)


# --------------------------------------------------------------------------------------
# one running epoch


class HostRun:
    """The threads of one epoch, batches on the host. Iterate it; `close` stops and joins everything."""

    def __init__(
        self,
        cfg: Config,
        plan: EpochPlan,
        schedule: Schedule,
        epoch: int,
        window_rng: Callable[[int, int], np.random.Generator | None],
        buffers: Sequence[npt.NDArray[Any]],
        scale_buffers: Sequence[npt.NDArray[np.float32]] = (),
        pools: Pools | None = None,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.schedule = schedule
        self.stop = threading.Event()
        # The loader's threads and outputs (`Pools`), else this run's own, let go by `close`.
        self.own_pools = pools is None
        self.pools = Pools(cfg) if pools is None else pools
        self.windows = WindowLoader(
            cfg, plan, epoch, window_rng, buffers, self.stop, scale_buffers=scale_buffers, pool=self.pools.read
        )
        self.gather_pool = Tasks(self.pools.gather)
        #: Chunks in flight: every gather thread busy, and ``prefetch`` batches ready ahead.
        self.depth = chunks_in_flight(cfg)
        self.recycler = self.pools.outputs
        self.scratch = threading.local()
        self.lock = threading.RLock()  # reentrant: a chunk's callback may run inside _pump
        self.closed = False

    def __iter__(self) -> Iterator[Batch]:
        return self._consume()

    # The schedule is driven by completions, under one lock: when a gather has taken its
    # rows of a window, and it was the last one to need that window, the window is
    # released and the next windows start loading into the freed slots; more chunks are
    # submitted (at most `depth` not yet consumed) as windows load and the consumer pops.
    # A slot is thus refilled as soon as the gathers are done with it, not when the
    # training loop has caught up, nor when a chunk that also spans the next window has
    # waited for that one to load: with two slots, that wait kept the window after next
    # from loading until the next was read in full, so the reads stopped at every window
    # boundary (the OrderedLoader's cold reads, docs/loaders.md "Read-ahead").
    def _consume(self) -> Iterator[Batch]:
        sched = self.schedule
        n_chunks = len(sched)
        if n_chunks == 0:
            return
        self.loads: dict[int, Future[WindowIndex]] = {}
        self.futures: dict[int, Future[list[Batch]]] = {}
        self.unread = sched.readers.copy()  # gathers yet to take their rows of each window
        self.next_load = int(sched.w_first[0])
        self.release_below = self.next_load  # windows before this are done with
        self.next_chunk = 0
        self.consumed = 0
        self.first_watched = False  # whether the second window's load waits on the first's
        for c in range(n_chunks):
            if self._stopped():
                return
            while True:
                with self.lock:
                    self.consumed = c
                    self._pump()
                    future = self.futures.pop(c, None)
                    first_load = self.loads.get(int(sched.w_first[0]))
                if future is not None:
                    break
                if self._stopped() or first_load is None:
                    return
                # Its windows wait for the first one's load (`_pump`): wait for it too, then pump.
                concurrent.futures.wait([first_load])
            for batch in future.result():
                if self._stopped():
                    return
                yield batch

    def _pump(self) -> None:
        """Start the loads whose slot is free and the chunks whose windows are loading (lock held)."""
        if self.closed:
            return
        sched = self.schedule
        n_slots = len(self.windows.buffers)
        last_window = int(sched.w_last[-1])
        first = int(sched.w_first[0])
        while self.next_load <= last_window and self.next_load - n_slots < self.release_below:
            # The first window read in place is indexed and checked before the second starts: on
            # its own it is ready sooner (on 2 cores, side by side they took twice as long), and
            # the second still has the first's gathers to load in.
            if self.next_load == first + 1 and self.windows.in_place[first] and not self.loads[first].done():
                if not self.first_watched:
                    self.first_watched = True
                    self.loads[first].add_done_callback(self._first_loaded)
                break
            self.loads[self.next_load] = self.windows.submit(self.next_load)
            self.next_load += 1
        while (
            self.next_chunk < len(sched)
            and self.next_chunk - self.consumed < self.depth
            and sched.w_last[self.next_chunk] < self.next_load
            and not self.closed
        ):
            c = self.next_chunk
            wanted = range(int(sched.w_first[c]), int(sched.w_last[c]) + 1)
            future = self.gather_pool.submit(self._chunk, c, {w: self.loads[w] for w in wanted})
            self.futures[c] = future
            self.next_chunk += 1

    def _first_loaded(self, _: Future[Any]) -> None:
        with self.lock:
            self._pump()

    def _taken(self, w: int) -> None:
        """A gather has taken its rows of window ``w``: release the windows no gather needs any more."""
        with self.lock:
            self.unread[w] -= 1
            if self.unread[self.release_below]:
                return
            last_window = int(self.schedule.w_last[-1])
            while self.release_below <= last_window and not self.unread[self.release_below]:
                self.loads.pop(self.release_below, None)
                self.release_below += 1
            self._pump()

    # -- one chunk, on a gather thread -------------------------------------------------
    def _chunk(self, c: int, loads: dict[int, Future[WindowIndex]]) -> list[Batch]:
        cfg, sched = self.cfg, self.schedule
        lo, hi = int(sched.lo[c]), int(sched.hi[c])
        n = hi - lo
        # float8_e4m3 is gathered and dequantized into the output in one pass (float8.take_dequantize).
        converts = cfg.out_dtype != cfg.stored and not cfg.float8
        acts, out = self._output(n, cfg.out_dtype)
        raw = self._scratch(n) if converts else out
        pieces: list[tuple[WindowIndex, int, int]] = []
        filled = 0
        for w, a, b in self.plan.segments(lo, hi):
            index = loads[w].result()
            if self.stop.is_set():
                raise CancelledError
            values, window_scales = self.windows.source(w)
            dest = raw[filled : filled + b - a]
            if window_scales is not None:
                float8.take_dequantize(values, window_scales, index.flat[a:b], dest, cfg.out_dtype)
            else:
                # mode="clip": with the default "raise", numpy gathers into a temporary and copies.
                np.take(values, index.flat[a:b], axis=0, out=dest, mode="clip")
            self._taken(w)
            pieces.append((index, a, b))
            filled += b - a
        if converts:
            cast_into(raw, cfg.stored, cfg.out_dtype, out)
        return self._batches(c, acts, pieces)

    def _batches(self, c: int, acts: Any, pieces: list[tuple[WindowIndex, int, int]]) -> list[Batch]:
        import torch

        cfg, sched = self.cfg, self.schedule

        # A chunk inside one window hands out slices of the window's index (each index serves one
        # window of one epoch, each of its rows one batch): no copy, and no numpy call that lets
        # go of the GIL, each of which costs a wait to take it back while other threads run
        # Python (0.05-0.4 ms on average on the 2-core development machine: docs/loaders.md).
        def column(get: Callable[[WindowIndex], npt.NDArray[Any] | None]) -> npt.NDArray[Any]:
            parts = [get(ix)[a:b] for ix, a, b in pieces]  # type: ignore[index]
            return np.concatenate(parts) if len(parts) > 1 else parts[0]

        examples = column(lambda ix: ix.examples)
        tokens = column(lambda ix: ix.tokens)
        layers = None if cfg.stack else column(lambda ix: ix.layers)
        labels = column(lambda ix: ix.labels) if cfg.selection.has_labels else None
        out = []
        size = cfg.batch_size
        first = int(sched.first_batch[c])
        for b in range(first, int(sched.stop_batch[c])):
            s = (b - first) * size
            e = min(s + size, len(examples))
            rows = e - s
            out.append(
                Batch(
                    acts=acts[s:e],
                    examples=torch.from_numpy(examples[s:e]),
                    tokens=torch.from_numpy(tokens[s:e]),
                    layers=(
                        torch.from_numpy(cfg.layer_values.copy()).expand(rows, len(cfg.layer_values))
                        if layers is None
                        else torch.from_numpy(layers[s:e])
                    ),
                    labels=None if labels is None else torch.from_numpy(labels[s:e]),
                )
            )
        return out

    def _output(self, n: int, dtype: str) -> tuple[Any, npt.NDArray[Any]]:
        """The ``(n, *row)`` output tensor of a chunk and its numpy view (pinned when asked)."""
        cfg = self.cfg
        shape = (n, *cfg.row_shape)
        if cfg.pin_memory:  # torch's caching host allocator recycles pinned blocks itself
            tensor = pinned_empty(shape, torch_dtype(dtype))
            return tensor, as_numpy(tensor, dtype)
        np_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)
        arr = self.recycler.get(shape, np_dtype)
        return to_tensor(arr, dtype, dtype), arr

    def _scratch(self, n: int) -> npt.NDArray[Any]:
        """This thread's stored-dtype array for gathers that are cast afterwards."""
        cfg = self.cfg
        arr: npt.NDArray[Any] | None = getattr(self.scratch, "arr", None)
        if arr is None or len(arr) < n:
            arr = np.empty((n, *cfg.row_shape), dtype=cfg.numpy_dtype)
            self.scratch.arr = arr
        return arr[:n]

    def _stopped(self) -> bool:
        return self.closed

    def close(self) -> None:
        with self.lock:  # no callback starts new work after this
            if self.closed:
                return
            self.closed = True
        self.stop.set()
        self.gather_pool.cancel()
        self.windows.close()
        with self.lock:
            self.loads, self.futures = {}, {}
        if self.own_pools:
            self.pools.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
