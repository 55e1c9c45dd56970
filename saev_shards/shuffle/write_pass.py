"""The write pass: load each bucket, sort it by key and append it to the output through `ShardWriter`.

Bucket ``k`` is piece ``k`` of every run, read in run order (one ``preadv`` per piece that
scatters its regions straight into the bucket's field arrays, checked against the piece's
digest; the runs without readahead, each piece's pages dropped once read: `RunFiles`), so
its rows are in source order; a stable sort by key gives the global order
(`order`). Rows are gathered in that order into batches of ``plan.batch_rows`` and a
writer thread appends them. One thread loads the next bucket meanwhile.

A `ShardWriter` opened with ``resume=True`` says where to start (`ShardWriter.next_example`):
buckets before it are skipped, the bucket holding it is sorted again and cut.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from ..codecs.bfloat16 import bf16_to_float32
from ..errors import ShuffleError
from ..fileio import BlockHasher
from ..writer import ShardWriter
from .plan import SOURCE_EXAMPLE, SOURCE_TOKEN, WRITE_QUEUE, ShufflePlan
from .scratch import REGION_ALIGN, Buffers, RunRecord, load_record, run_file
from .source import READ_THREADS

#: The page size: the unit of the page cache a dropped range is rounded to.
PAGE = mmap.PAGESIZE


class RunIndex:
    """Every run's record: rows per (run, bucket) and where each piece lies."""

    def __init__(self, plan: ShufflePlan) -> None:
        records: list[RunRecord] = []
        for c in range(plan.n_chunks):
            record = load_record(plan.work, c, plan.n_buckets, plan.layout)
            if record is None:
                raise ShuffleError(f"{plan.work / run_file(c)}: missing or incomplete; run the shuffle again")
            records.append(record)
        self.records = records
        self.counts = np.array([r.counts for r in records], dtype=np.int64).reshape(len(records), plan.n_buckets)
        self.offsets = [plan.layout.piece_offsets(r.counts) for r in records]
        totals = self.counts.sum(axis=0)
        #: Output row of each bucket's first row, then the total.
        self.bucket_first = np.concatenate([[0], np.cumsum(totals)]).astype(np.int64)
        if int(self.bucket_first[-1]) != plan.n_tokens:
            found = int(self.bucket_first[-1])
            raise ShuffleError(f"{plan.work}: the runs hold {found} rows, expected {plan.n_tokens}")

    def rows(self, bucket: int) -> int:
        return int(self.bucket_first[bucket + 1] - self.bucket_first[bucket])


def write_buckets(
    plan: ShufflePlan,
    writer: ShardWriter,
    on_rows: Callable[[int], None],
    after_bucket: Callable[[int], None],
    buffers: Buffers | None = None,
) -> None:
    """Append output rows ``[writer.next_example, writer.stop)`` to ``writer`` (opened with ``background=False``).

    ``buffers``: where the buckets and batches are carved from (the scatter pass's, reused);
    None: a mapping of this call's own."""
    start, stop = writer.next_example, writer.stop
    if start >= stop:
        return
    index = RunIndex(plan)
    first = index.bucket_first
    buckets = range(int(np.searchsorted(first, start, side="right")) - 1, int(np.searchsorted(first, stop)))
    most = max(index.rows(k) for k in buckets)
    own = buffers is None
    carved = Buffers() if buffers is None else buffers
    fields = plan.layout.fields
    sizes = [most * f.row_nbytes for _ in range(2) for f in fields]
    sizes += [plan.batch_rows * f.row_nbytes for _ in range(WRITE_QUEUE + 2) for f in fields]
    views = iter(carved.carve(sizes))
    sets = [_BucketArrays(plan, most, views) for _ in range(2)]
    batches = [_arrays(plan, plan.batch_rows, views) for _ in range(WRITE_QUEUE + 2)]
    runs = RunFiles(plan)
    loads = ThreadPoolExecutor(1, "saev-shuffle-load")
    sink = _WriterThread(plan, writer, batches)
    written: list[tuple[int, int]] = []  # (batches put up to the end of a bucket, bucket) not yet reported
    failed = True
    loading: Future[_BucketArrays] | None = None
    try:
        loading = loads.submit(_load, plan, index, runs, buckets[0], sets[0])
        for i, k in enumerate(buckets):
            arrays = loading.result()
            if i + 1 < len(buckets):
                loading = loads.submit(_load, plan, index, runs, buckets[i + 1], sets[(i + 1) % 2])
            n = index.rows(k)
            order = np.argsort(arrays["key"][:n], kind="stable")  # ties keep source order
            lo = max(0, start - int(first[k]))
            hi = min(n, stop - int(first[k]))
            step = sink.batch_rows
            for a in range(lo, hi, step):
                sink.put(arrays, order[a : min(hi, a + step)])  # copies the rows: the bucket is free after
                on_rows(min(hi, a + step) - a)
                _fire(written, sink, after_bucket)
            del order
            written.append((sink.put_count, k))  # bucket k is written once its batches are
        sink.close()
        _fire(written, sink, after_bucket)
        failed = False
    finally:
        sink.stop()
        loads.shutdown(wait=not failed, cancel_futures=True)  # a blocked read is not waited for after an error
        if loading is None:
            runs.close()
        else:  # after an error a load may still be reading: the descriptors are closed once it ends
            loading.add_done_callback(lambda _: runs.close())
        del sets, batches, views
        if own:
            carved.close()


def _fire(pending: list[tuple[int, int]], sink: _WriterThread, after_bucket: Callable[[int], None]) -> None:
    """Report the buckets whose every batch the writer has appended (oldest first)."""
    while pending and pending[0][0] <= sink.done_count:
        after_bucket(pending.pop(0)[1])


class _BucketArrays(dict[str, npt.NDArray[Any]]):
    """One array per run field, sized for the largest bucket, on the next of ``views``."""

    def __init__(self, plan: ShufflePlan, rows: int, views: Iterator[memoryview]) -> None:
        super().__init__(_arrays(plan, rows, views))


def _arrays(plan: ShufflePlan, rows: int, views: Iterator[memoryview]) -> dict[str, npt.NDArray[Any]]:
    """One array of ``rows`` rows per run field, each on the next of ``views`` (as many bytes)."""
    return {
        f.name: np.frombuffer(next(views), f.dtype, count=rows * math.prod(f.shape)).reshape(rows, *f.shape)
        for f in plan.layout.fields
    }


class RunFiles:
    """The run files, each opened once for the whole write pass and read piece by piece.

    Each run is read in `n_buckets` requests far apart in time (one per bucket), so the
    kernel's readahead (up to the disk's ``read_ahead_kb``, 8 MiB on the development machine)
    only reads bytes of the next pieces that are evicted again before their bucket comes
    when the page cache is small (a memory limit): 1.3-1.7 x the runs' bytes were read from disk.
    The descriptors are opened with POSIX_FADV_RANDOM (no readahead), and the pages of a
    piece are dropped once it is read (POSIX_FADV_DONTNEED: they are never read again), so
    the page cache holds no scratch for the kernel to reclaim under memory pressure.
    """

    def __init__(self, plan: ShufflePlan) -> None:
        self.plan = plan
        self.fds: dict[int, int] = {}
        self.lock = threading.Lock()

    def fd(self, chunk: int) -> int:
        with self.lock:
            fd = self.fds.get(chunk)
            if fd is None:
                fd = self.fds[chunk] = os.open(self.plan.work / run_file(chunk), os.O_RDONLY | os.O_CLOEXEC)
                _advise(fd, 0, 0, "POSIX_FADV_RANDOM")
            return fd

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def _advise(fd: int, offset: int, length: int, name: str) -> None:
    """``posix_fadvise`` where the system has it (a hint: any refusal is ignored)."""
    advice = getattr(os, name, None)
    if advice is not None and length >= 0:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, advice)


def _load(plan: ShufflePlan, index: RunIndex, runs: RunFiles, bucket: int, arrays: _BucketArrays) -> _BucketArrays:
    """Read bucket ``bucket`` (piece ``bucket`` of every run, in run order) into ``arrays``,
    `READ_THREADS` pieces at a time."""
    rows = np.concatenate([[0], np.cumsum(index.counts[:, bucket])]).tolist()
    pieces = [(c, rows[c]) for c in range(len(index.records)) if index.counts[c, bucket]]
    with ThreadPoolExecutor(READ_THREADS, "saev-shuffle-piece") as pool:
        list(pool.map(lambda piece: _load_piece(plan, index, runs, bucket, arrays, *piece), pieces))
    return arrays


def _load_piece(
    plan: ShufflePlan, index: RunIndex, runs: RunFiles, bucket: int, arrays: _BucketArrays, c: int, row: int
) -> None:
    """Piece ``bucket`` of run ``c`` into ``arrays`` from row ``row``, checked against its digest."""
    record = index.records[c]
    pad = bytearray(REGION_ALIGN)
    n = record.counts[bucket]
    views: list[memoryview] = []
    for field, _, nbytes in plan.layout.regions(n):
        views.append(arrays[field.name][row : row + n].reshape(-1).view(np.uint8).data)
        if nbytes % REGION_ALIGN:
            views.append(memoryview(pad)[: REGION_ALIGN - nbytes % REGION_ALIGN])
    path = plan.work / run_file(c)
    fd = runs.fd(c)
    start, stop = int(index.offsets[c][bucket]), int(index.offsets[c][bucket + 1])
    _preadv_exact(fd, views, start, path)
    # Its pages, but for a last one it shares with the next piece (read with the next bucket).
    first = start - start % PAGE
    _advise(fd, first, stop - stop % PAGE - first, "POSIX_FADV_DONTNEED")
    h = BlockHasher()
    for field, _, _ in plan.layout.regions(n):
        h.update(arrays[field.name][row : row + n].reshape(-1).view(np.uint8).data)
    if h.hexdigest() != record.digests[bucket]:
        raise ShuffleError(
            f"{path}: piece {bucket} does not match its digest in {path.with_suffix('.json').name} "
            f"(scratch data damaged); remove {plan.work} and run the shuffle again"
        )


def _bfloat16_input(bits: npt.NDArray[np.uint16]) -> Any:
    """Stored bfloat16 bits as `ShardWriter` input (it takes values, not bits): a torch bfloat16
    view when torch is already imported (no copy), else float32, which casts back exactly."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return bf16_to_float32(bits)


def _preadv_exact(fd: int, views: list[memoryview], offset: int, path: os.PathLike[str]) -> None:
    """Fill every view, in order, from ``offset`` of ``fd`` (``preadv`` may return short)."""
    views = [v for v in views if v.nbytes]
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise ShuffleError(f"{path}: ends at byte {offset}, before the pieces its record lists")
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views.pop(0)
        if got:
            views[0] = views[0][got:]


class _WriterThread:
    """Gathers batches in the caller's thread and appends them to the writer in its own.

    ``WRITE_QUEUE`` batches wait while one is written; their buffers are recycled.
    """

    def __init__(self, plan: ShufflePlan, writer: ShardWriter, batches: list[dict[str, npt.NDArray[Any]]]) -> None:
        self.plan = plan
        self.writer = writer
        self.batch_rows = plan.batch_rows
        self.free: queue.Queue[dict[str, npt.NDArray[Any]]] = queue.Queue()
        for batch in batches:  # WRITE_QUEUE + 2 of `batch_rows` rows
            self.free.put(batch)
        self.todo: queue.Queue[tuple[dict[str, npt.NDArray[Any]], int] | None] = queue.Queue(WRITE_QUEUE)
        self.error: BaseException | None = None
        self.idle = threading.Condition()
        self.in_hand = 0  # batches put and not yet written
        self.put_count = 0  # batches put so far
        self.done_count = 0  # batches written (or dropped after an error) so far
        self.thread = threading.Thread(target=self._run, name="saev-shuffle-append", daemon=True)
        self.thread.start()

    def put(self, arrays: dict[str, npt.NDArray[Any]], rows: npt.NDArray[np.int64]) -> None:
        self._check()
        batch = self.free.get()
        n = len(rows)
        for name, values in arrays.items():
            if name != "key":
                # mode="clip": the rows are valid by construction, and numpy skips its buffered bounds check.
                np.take(values, rows, axis=0, out=batch[name][:n], mode="clip")
        with self.idle:
            self.in_hand += 1
            self.put_count += 1
        self.todo.put((batch, n))

    def _run(self) -> None:
        while True:
            item = self.todo.get()
            if item is None:
                return
            batch, n = item
            try:
                if self.error is None:
                    self._write(batch, n)
            except BaseException as err:
                self.error = err
            finally:
                self.free.put(batch)
                with self.idle:
                    self.in_hand -= 1
                    if self.error is None:
                        self.done_count += 1
                    self.idle.notify_all()

    def _write(self, batch: dict[str, npt.NDArray[Any]], n: int) -> None:
        md = self.plan.output
        acts: Any = batch["acts"][:n].reshape(n, md.n_layers, 1, md.d_model)
        if md.dtype == "bfloat16":
            acts = _bfloat16_input(acts)
        # float8_e4m3: the values' bytes and their scales, quantized in the scatter pass
        scales = batch["scales"][:n].reshape(n, md.n_layers, 1) if "scales" in batch else None
        columns = {SOURCE_EXAMPLE: batch[SOURCE_EXAMPLE][:n], SOURCE_TOKEN: batch[SOURCE_TOKEN][:n]}
        columns.update({name: batch[f"column.{name}"][:n] for name in self.plan.columns})
        labels = batch["label"][:n].reshape(n, 1) if "label" in batch else None
        self.writer.write(acts, labels=labels, columns=columns, scales=scales)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def wait_idle(self) -> None:
        """Wait until every batch put so far is written (and raise its error, if any)."""
        with self.idle:
            while self.in_hand and self.error is None:
                self.idle.wait(0.1)
        self._check()

    def close(self) -> None:
        self.wait_idle()
        self.stop()
        self._check()

    def stop(self) -> None:
        """End the thread; after an error it drains the queue without writing, so this never blocks for long."""
        if self.thread.is_alive():
            self.todo.put(None)
            self.thread.join()
