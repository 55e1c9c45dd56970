"""Reading the windows of one epoch: their spans into slot buffers (or checked in place in the
page cache) on a pool of threads, and each window's index beside them (`WindowLoader`).

How a span is read (`WindowLoader.slice_reads`): every layer chosen, one ``pread`` of its
examples; a proper subset of the layers, one ``preadv`` per example for each run of
neighbouring chosen layers, after a hint that has the disk read all of the span's slices at
once (`Shards.prefetch_slices`), so a selection costs the disk the bytes it needs and no more.
The span's slices are one call to the reader (`Shards.read_slices_raw`, and
`read_slices_scales` for float8_e4m3: arguments checked once, nothing but ``preadv`` in the
loop); where one of those raises (`FileSizeError`, `ScaleError`), the span is read again slice
by slice, so the error is the first slice at fault's, its values before its scales, as it
always was. Layers are interleaved within each example, so one layer of several is a strided
walk that the kernel's readahead does not follow: without the hint each read thread waited for
one slice at a time, and with whole examples read instead (what slices under
`plan.MIN_SLICE_READ` used to get) the disk read every layer to deliver one. Slices under
`MIN_HINTED_SLICE`, and remote caches (whose blocks are fetched whole anyway), still read whole
examples; the span plan, the buffers' layout and so every batch are the same either way.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import FileSizeError, ScaleError
from .plan import WindowIndex, index_window
from .pools import Tasks
from .schedule import Config, Epoch

#: Slices of a proper subset of the layers at least this large (bytes) are read one by one,
#: hinted, even where the span plan lays whole examples out in the buffer (slices under
#: `plan.MIN_SLICE_READ`); smaller ones cost more in calls than reading whole examples does.
MIN_HINTED_SLICE = 16 << 10


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
        epoch: Epoch,
        buffers: Sequence[npt.NDArray[Any]],
        stop: threading.Event,
        ready_to_write: Callable[[int], None] = lambda slot: None,
        finish: Callable[[int, int, WindowIndex], Any] = lambda w, slot, index: index,
        scale_buffers: Sequence[npt.NDArray[np.float32]] = (),
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.cfg = cfg
        self.epoch = epoch
        self.plan = epoch.plan
        #: Window 0's index in the cache mapped in place, if computed ahead (`ahead`); let go of once used.
        self.first_index = epoch.first_index
        self.buffers = buffers
        self.scale_buffers = scale_buffers
        self.stop = stop
        self.ready_to_write = ready_to_write
        self.finish = finish
        #: Whether each window loading or loaded is read in place (else into its slot's buffer).
        self.in_place: dict[int, bool] = {}
        #: `early_window`, when read in place for the first time: ``(index, gatherable)`` futures, the second
        #: true once every page the window's gathers read is found in the page cache and its shards
        #: checked (`_gatherable`): its gathers may start then, while its pages are still being mapped.
        self.early: dict[int, tuple[Future[WindowIndex], Future[bool]]] = {}
        #: The window that may be gathered early if read in place (the host run's first), or None.
        self.early_window: int | None = None
        owned = pool is None
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=cfg.read_threads, thread_name_prefix="saev-loader-read")
        self.pool = Tasks(pool, owned)
        spans, shards = cfg.spans, cfg.shards
        md = shards.metadata
        subset = len(spans.read_positions) < md.n_layers
        local = not shards.files.prefetches  # a remote cache fetches each span's blocks whole
        slice_bytes = md.tokens_per_ex * md.d_model * md.itemsize
        #: Whether spans are read slice by slice, only the chosen layers (else whole examples).
        self.slice_reads = subset and (not spans.whole or (local and slice_bytes >= MIN_HINTED_SLICE))
        #: Whether each span's slices are hinted to the storage before they are read.
        self.hint_slices = self.slice_reads and local
        #: The chosen layers' rows in a span's buffer and their positions in the files.
        self.slice_rows: list[int] = spans.slots.tolist()
        self.slice_positions: list[int] = spans.read_positions.tolist()

    def slot(self, w: int) -> int:
        return w % len(self.buffers)

    def submit(self, w: int) -> Future[Any]:
        """Start loading window ``w``; the future's result is ``finish(w, slot, index)``."""
        cfg = self.cfg
        window = self.plan.windows[w]
        slot = self.slot(w)
        rows = cfg.spans.rows[window.spans]
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(rows[:-1], out=offsets[1:])
        # Read in place when the page cache holds the window (its spans' first pages say so),
        # else into the slot's buffer: from disk, the copy into the buffer is the read itself.
        mapped, spans = cfg.mapped, cfg.spans
        position = None if spans.whole else int(spans.read_positions[0])
        self.in_place[w] = mapped is not None and all(
            mapped.probably_resident(int(spans.start[b]), position) for b in window.spans.tolist()
        )
        # A remote cache starts fetching the whole window's spans now (unless read in place: its
        # blocks are mapped from the block cache), a float8_e4m3 one its scales.
        if (cfg.shards.files.prefetches and not self.in_place[w]) or cfg.float8:
            for b in window.spans.tolist():
                cfg.shards.prefetch(int(cfg.spans.start[b]), int(cfg.spans.stop[b]))
        early = (
            w == self.early_window
            and self.in_place[w]
            and mapped is not None
            # else its load is as quick as the check: nothing to gain
            and not all(mapped.populated[int(spans.start[b]) : int(spans.stop[b])].all() for b in window.spans)
        )
        if self.in_place[w] and not early and mapped is not None and not mapped.bounded:
            # A window the page cache holds, of a cache that fits in memory, costs its index and
            # its pages' checks (microseconds a block): one task does both in turn. Spread over the
            # read threads as a disk's reads are (requests in flight), the index and a task per
            # thread cost more in hand-offs between threads than they saved: on 2 busy cores the
            # shuffled loader delivered 0.91 and the ordered walk 0.96 of what they do this way.
            load = _Countdown(functools.partial(self.finish, w, slot))
            load.watch([self.pool.submit(self._load_in_place, w, window.spans)])
            return load.done
        # The index first: it needs no data, so it is ready by the time the reads are.
        index = self.pool.submit(self._index, w)
        parts: list[Future[Any]] = [index]
        if early:
            self.early[w] = (index, self.pool.submit(self._gatherable, w))
        # One task per read thread, each taking the next block in window order until none is
        # left: as balanced as a task per block (no thread idles while others read the last
        # spans of a window), with a handful of futures per window instead of one per block.
        next_block = itertools.count()
        parts += [
            self.pool.submit(self._read_blocks, slot, window.spans, offsets, next_block, self.in_place[w])
            for _ in range(min(len(rows), cfg.read_threads))
        ]
        load = _Countdown(functools.partial(self.finish, w, slot))
        load.watch(parts)
        return load.done

    def _load_in_place(self, w: int, ids: npt.NDArray[np.int64]) -> WindowIndex:
        """Window ``w``'s index, then its blocks checked in the page cache (`_read_blocks` in place):
        runs of neighbouring blocks mapped before and still there at once, the rest block by block."""
        index = self._index(w)
        mapped, spans = self.cfg.mapped, self.cfg.spans
        assert mapped is not None
        done = mapped.still_resident(spans.start[ids], spans.stop[ids]).tolist()
        for b, resident in zip(ids.tolist(), done, strict=True):
            if self.stop.is_set():
                raise CancelledError
            self._check_in_place(b, resident)
        return index

    def _index(self, w: int) -> WindowIndex:
        """Window ``w``'s index; read in place, in the map's vectors, and for a cache larger than
        memory the pages of the window whose slot this one takes unmapped."""
        cfg = self.cfg
        window, rng = self.plan.windows[w], self.epoch.rng(w)
        before = w - len(self.buffers)  # the window whose slot this one takes: done with
        if cfg.mapped is not None and cfg.mapped.bounded and self.in_place.pop(before, False):
            for b in self.plan.windows[before].spans.tolist():
                cfg.mapped.unmap_pages(int(cfg.spans.start[b]), int(cfg.spans.stop[b]))
        ahead = None
        if w == 0:  # its index may have been computed while the epoch before ended (`ahead`)
            ahead, self.first_index = self.first_index, None
        if not self.in_place[w]:
            return index_window(cfg.selection, cfg.spans, window, rng)
        assert cfg.mapped is not None
        if ahead is not None:  # computed in the cache read in place: the same index
            return ahead
        return index_window(cfg.selection, cfg.spans, window, rng, cfg.mapped.source)

    def _gatherable(self, w: int) -> bool:
        """Whether window ``w`` (read in place) can be gathered before it is loaded: its shards still
        hold its examples and a float8_e4m3 cache's scales are valid (`FileSizeError` and
        `check_scales`'s error otherwise, as its load would raise), and every page of its examples is
        in the page cache (one ``mincore`` per block), so that its gathers read memory, not the disk.
        Its load maps those pages once per loader (``MADV_POPULATE_READ``): on a new loader's first
        window, about as long as the index; the gathers fault them in meanwhile."""
        mapped, spans = self.cfg.mapped, self.cfg.spans
        assert mapped is not None
        kinds = (False, True) if mapped.scales is not None else (False,)
        for b in self.plan.windows[w].spans.tolist():
            if self.stop.is_set():
                raise CancelledError
            start, stop = int(spans.start[b]), int(spans.stop[b])
            mapped.check_size(start, stop)
            if not all(mapped.resident(*mapped.byte_range(start, stop, scales=scales)) for scales in kinds):
                return False
            mapped.check_scales(start, stop, spans)
        return True

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
        for i in next_block:  # itertools.count: its next() is atomic, each block goes to one thread
            if i >= len(ids):
                return
            if self.stop.is_set():
                raise CancelledError
            if in_place:
                self._check_in_place(int(ids[i]))
            else:
                self._read_block(int(ids[i]), buffer, int(offsets[i]), scales)

    def _check_in_place(self, block: int, resident: bool = False) -> None:
        """Block ``block`` of a window read in place: its pages in the page cache and mapped (unless
        ``resident``: `CacheMap.still_resident` found them there), a float8_e4m3 cache's scales checked."""
        mapped, spans = self.cfg.mapped, self.cfg.spans
        assert mapped is not None
        start, stop = int(spans.start[block]), int(spans.stop[block])
        if not resident:
            mapped.make_resident(start, stop, spans, self.stop)
        mapped.check_scales(start, stop, spans)  # read from the files, they are checked there

    def _read_block(
        self, block: int, buffer: npt.NDArray[Any], row_offset: int, scales: npt.NDArray[np.float32] | None
    ) -> None:
        cfg = self.cfg
        spans = cfg.spans
        start, stop = int(spans.start[block]), int(spans.stop[block])
        count = stop - start
        rows_per_ex = spans.rows_per_ex
        first, last = row_offset * cfg.tokens, (row_offset + count * rows_per_ex) * cfg.tokens
        slices = buffer[first:last].reshape(count, rows_per_ex, cfg.tokens, cfg.d_model)
        scale_slices = None if scales is None else scales[first:last].reshape(count, rows_per_ex, cfg.tokens)
        if not self.slice_reads:
            cfg.shards.read_range_raw(start, stop, slices)
            if scale_slices is not None:
                cfg.shards.read_range_scales(start, stop, scale_slices)
            return
        # The chosen layers only: their rows in the buffer (every layer's row when the plan
        # lays whole examples out, else one per chosen layer) and their positions in the files.
        rows, positions = self.slice_rows, self.slice_positions
        if self.hint_slices:
            cfg.shards.prefetch_slices(start, stop, positions)
        try:  # the span's slices at once: its arguments checked once, nothing but preadv in the loop
            cfg.shards.read_slices_raw(start, stop, positions, slices, rows)
            if scale_slices is not None:
                cfg.shards.read_slices_scales(start, stop, positions, scale_slices, rows)
        except (FileSizeError, ScaleError):
            # Slice by slice, as before: the error of the first slice at fault (its values, then
            # its scales), whichever of the span's reads raised first above.
            self._read_slice_by_slice(start, count, slices, scale_slices)

    def _read_slice_by_slice(
        self, start: int, count: int, slices: npt.NDArray[Any], scale_slices: npt.NDArray[np.float32] | None
    ) -> None:
        shards = self.cfg.shards
        for e in range(count):
            if self.stop.is_set():
                raise CancelledError
            for row, position in zip(self.slice_rows, self.slice_positions, strict=True):
                shards.read_example_raw(start + e, position, slices[e, row])
                if scale_slices is not None:
                    shards.read_example_scales(start + e, position, scale_slices[e, row])

    def close(self) -> None:
        self.stop.set()
        self.pool.cancel()
        # Nothing of this epoch outlives it: the caller's callbacks may refer back to its run.
        self.buffers = ()
        self.early = {}
        self.first_index = None
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
