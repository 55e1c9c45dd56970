"""One epoch on the host (`HostRun`): windows read by a pool of threads (`windows`), batches
gathered by another (`pools`), the consumer popping finished batches.

Work is cut so that every thread spends its time in large numpy calls that release the
GIL, and the consumer's thread (the training loop) does almost nothing:

* **Reads.** A window's spans are read by ``read_threads`` threads, a few spans per task,
  into one of a few *slot* buffers (two, unless one batch spans more windows). The
  window's index (its permutation and the batches' metadata) is computed beside them. A
  window the page cache already holds, of a local cache, is not copied: the gathers read it
  in place through one mapping of the whole cache (`mapped`), and its "read" only checks and
  maps its pages. From a remote cache the whole window is announced first
  (`Shards.prefetch`), so its spans are fetched with many requests in flight while the
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
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs import float8, gather
from .batch import Batch
from .outputs import cast_into
from .plan import WindowIndex
from .pools import Pools, Tasks, chunks_in_flight
from .schedule import Config, Epoch
from .tensors import as_numpy, pinned_empty, to_tensor, torch_dtype
from .windows import WindowLoader


class HostRun:
    """The threads of one epoch, batches on the host. Iterate it; `close` stops and joins everything."""

    def __init__(
        self,
        cfg: Config,
        epoch: Epoch,
        buffers: Sequence[npt.NDArray[Any]],
        scale_buffers: Sequence[npt.NDArray[np.float32]] = (),
        pools: Pools | None = None,
    ) -> None:
        self.cfg = cfg
        self.epoch = epoch
        self.plan = epoch.plan
        self.schedule = epoch.schedule
        self.stop = threading.Event()
        # The loader's threads and outputs (`Pools`), else this run's own, let go by `close`.
        self.own_pools = pools is None
        self.pools = Pools(cfg) if pools is None else pools
        self.windows = WindowLoader(cfg, epoch, buffers, self.stop, scale_buffers=scale_buffers, pool=self.pools.read)
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
        self.first_load: Future[WindowIndex] = Future()  # the first window's load, once `_pump` submits it
        # The first window, read in place, may be gathered before it is loaded (`WindowLoader.early`).
        self.windows.early_window = self.next_load
        for c in range(n_chunks):
            if self._stopped():
                return
            while True:
                with self.lock:
                    self.consumed = c
                    self._pump()
                    future = self.futures.pop(c, None)
                    first_load = self.first_load
                if future is not None:
                    break
                if self._stopped():
                    return
                # Its windows wait for the first one's load (`_pump`): wait for it too, then pump.
                concurrent.futures.wait([first_load])
            for batch in future.result():
                if self._stopped():
                    return
                yield batch
            if c == 0 and self.windows.early and not self._stopped():
                self.first_load.result()  # gathered early: its load's failure, if any, is the epoch's

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
            if self.next_load == first + 1 and self.windows.in_place[first] and not self.first_load.done():
                if not self.first_watched:
                    self.first_watched = True
                    self.first_load.add_done_callback(self._first_loaded)
                break
            self.loads[self.next_load] = self.windows.submit(self.next_load)
            if self.next_load == len(self.plan.windows) - 1:
                self.epoch.after_last_load(self.loads[self.next_load])
            if self.next_load == first:
                self.first_load = self.loads[first]
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
        # A callback of the read pool: at the interpreter's exit its pools may be shut down
        # before this run is closed (`Tasks.submit`); nothing is waiting for the next loads then.
        with self.lock, contextlib.suppress(CancelledError):
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
        # float8_e4m3 is gathered and dequantized into the output in one pass (float8.take_dequantize),
        # float16 and bfloat16 gathered and widened to float32 in one (gather.take_widen, compiled).
        converts = cfg.out_dtype != cfg.stored and not cfg.float8
        widens = converts and cfg.out_dtype == "float32" and cfg.stored in gather.WIDENS and gather.kernels_ready()
        converts = converts and not widens
        acts, out = self._output(n, cfg.out_dtype)
        raw = self._scratch(n) if converts else out
        pieces: list[tuple[WindowIndex, int, int]] = []
        filled = 0
        for w, a, b in self.plan.segments(lo, hi):
            early = self._early_index(c, w)
            index = loads[w].result() if early is None else early
            if self.stop.is_set():
                raise CancelledError
            values, window_scales = self.windows.source(w)
            dest = raw[filled : filled + b - a]
            if window_scales is not None:
                float8.take_dequantize(values, window_scales, index.flat[a:b], dest, cfg.out_dtype)
            elif widens:
                if not gather.take_widen(values, index.flat[a:b], dest, cfg.stored):  # `numpy_only` meanwhile
                    scratch = self._scratch(b - a)
                    np.take(values, index.flat[a:b], axis=0, out=scratch, mode="clip")
                    cast_into(scratch, cfg.stored, cfg.out_dtype, dest)
            else:
                # mode="clip": with the default "raise", numpy gathers into a temporary and copies.
                np.take(values, index.flat[a:b], axis=0, out=dest, mode="clip")
            self._taken(w)
            pieces.append((index, a, b))
            filled += b - a
        if converts:
            cast_into(raw, cfg.stored, cfg.out_dtype, out)
        return self._batches(c, acts, pieces)

    def _early_index(self, c: int, w: int) -> WindowIndex | None:
        """The index of window ``w`` if the first chunk may gather it before it is loaded (the epoch's
        first window, read in place, found in the page cache: `WindowLoader.early`), else None.
        Its first batch then waits for the window's index and checks, not for its pages' mapping."""
        early = self.windows.early.get(w) if c == 0 else None
        if early is None:
            return None
        index, gatherable = early
        return index.result() if gatherable.result() else None

    def _batches(self, c: int, acts: Any, pieces: list[tuple[WindowIndex, int, int]]) -> list[Batch]:
        cfg, sched = self.cfg, self.schedule

        # A chunk inside one window hands out slices of the window's index (each index serves one
        # window of one epoch, each of its rows one batch): no copy, and no numpy call that lets
        # go of the GIL, each of which costs a wait to take it back while other threads run
        # Python (0.05-0.4 ms on average on the 2-core development machine: docs/loaders.md).
        first, stop = int(sched.first_batch[c]), int(sched.stop_batch[c])
        if len(pieces) == 1:  # inside one window: each column a slice of the window's
            ix, a, b = pieces[0]
            examples, tokens, layers, labels = ix.examples[a:b], ix.tokens[a:b], ix.layers, ix.labels
            layers = None if layers is None else layers[a:b]
            labels = None if labels is None else labels[a:b]
        else:  # across windows: each column joined from the windows' slices

            def joined(name: str) -> npt.NDArray[Any]:
                return np.concatenate([getattr(ix, name)[a:b] for ix, a, b in pieces])

            examples, tokens = joined("examples"), joined("tokens")
            layers = None if cfg.stack else joined("layers")
            labels = joined("labels") if cfg.selection.has_labels else None
        if stop - first == 1:  # one batch, the whole chunk (the usual case: no slicing)
            return [self._batch(acts, examples, tokens, layers, labels)]
        size, n = cfg.batch_size, len(examples)
        out = []
        for k in range(stop - first):
            s, e = k * size, min((k + 1) * size, n)
            out.append(
                self._batch(
                    acts[s:e],
                    examples[s:e],
                    tokens[s:e],
                    None if layers is None else layers[s:e],
                    None if labels is None else labels[s:e],
                )
            )
        return out

    def _batch(
        self,
        acts: Any,
        examples: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
        layers: npt.NDArray[np.int64] | None,
        labels: npt.NDArray[np.uint8] | None,
    ) -> Batch:
        import torch

        from_numpy = torch.from_numpy
        if layers is None:  # stacked: every row holds every chosen layer
            values = self.cfg.layer_values
            layer_col = from_numpy(values.copy()).expand(len(examples), len(values))
        else:
            layer_col = from_numpy(layers)
        return Batch(
            acts=acts,
            examples=from_numpy(examples),
            tokens=from_numpy(tokens),
            layers=layer_col,
            labels=None if labels is None else from_numpy(labels),
        )

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
            self.first_load = Future()  # its callback refers back to this run: no cycle outlives it
        if self.own_pools:
            self.pools.shutdown()

    def __del__(self) -> None:
        # Not contextlib.suppress: it may be gone at interpreter shutdown (`Shards.__del__`).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: S110
            pass
