"""The scratch files of a shuffle: one *run* per source chunk, cut into one *piece* per bucket.

A shuffle's work folder (``.shuffle-<output hash>/``, this library's own layout, never
published) holds:

* ``plan.json``: what the runs were cut for (source, selection, seed, dtype, chunking,
  bucket count, row layout). Runs made for another plan are discarded.
* ``run<06d>.bin``: chunk ``c``'s chosen tokens, grouped by bucket: piece ``0`` first, then
  piece ``1``... Piece ``k`` holds the chunk's tokens of bucket ``k`` in source order, one
  region per field (activations, then sort key, source example, source token, label,
  per-token columns), each region padded to `REGION_ALIGN` bytes. Written front to back in
  large O_DIRECT requests, then fsynced (while the next run is written).
* ``run<06d>.json``: its record, written (atomically) only after the run is complete and
  durable: the chunk's examples, rows per piece and each piece's xxh3_128. A run without a
  record is redone; a piece whose digest differs when it is read back is an error.

`Buffers`: the memory the runs pass through, one mapping both passes of a process carve
their large buffers from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..fileio import (
    DIRECT_ALIGN,
    aligned_buffer,
    naming_disk_full,
    open_direct,
    pwrite_direct,
    write_file_atomic,
)
from ..protocol.jsonfile import strict_json_loads

#: Every field region of a piece starts at a multiple of this (aligned numpy views).
REGION_ALIGN = 64
#: Bytes per O_DIRECT write request of a run file (a multiple of the 4 KiB alignment).
DIRECT_WRITE = 16 << 20
#: O_DIRECT requests in flight per run file (the writer's own setting).
DIRECT_IN_FLIGHT = 2
PLAN_FILE = "plan.json"


def run_file(chunk: int) -> str:
    return f"run{chunk:06d}.bin"


def run_record_file(chunk: int) -> str:
    return f"run{chunk:06d}.json"


@dataclasses.dataclass(frozen=True)
class Field:
    """One per-row field of a run: its name, dtype and per-row shape."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...] = ()

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype.str, list(self.shape)]


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The fields every row of a run carries, in region order."""

    fields: tuple[Field, ...]

    @property
    def row_nbytes(self) -> int:
        return sum(f.row_nbytes for f in self.fields)

    def regions(self, n: int) -> list[tuple[Field, int, int]]:
        """``(field, offset, nbytes)`` of each region of a piece of ``n`` rows (offsets from its start)."""
        out = []
        offset = 0
        for f in self.fields:
            nbytes = n * f.row_nbytes
            out.append((f, offset, nbytes))
            offset += _aligned(nbytes)
        return out

    def piece_nbytes(self, n: int) -> int:
        return sum(_aligned(n * f.row_nbytes) for f in self.fields)

    def piece_offsets(self, counts: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Byte offset of each piece in a run whose pieces hold ``counts`` rows, plus the run's length."""
        sizes = [self.piece_nbytes(int(n)) for n in counts]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def to_json(self) -> list[Any]:
        return [f.to_json() for f in self.fields]


def _aligned(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A complete run: chunk ``chunk`` covered examples ``[start, stop)``; rows and digest per piece."""

    chunk: int
    start: int
    stop: int
    counts: tuple[int, ...]
    digests: tuple[str, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "chunk": self.chunk,
            "start": self.start,
            "stop": self.stop,
            "counts": list(self.counts),
            "xxh3_128": list(self.digests),
            "nbytes": self.nbytes,
        }


def load_record(work: Path, chunk: int, n_buckets: int, layout: RowLayout) -> RunRecord | None:
    """Chunk ``chunk``'s record if it and its run file check out (sizes only), else None."""
    path = work / run_record_file(chunk)
    try:
        obj = strict_json_loads(path.read_bytes())
        record = RunRecord(
            chunk=int(obj["chunk"]),
            start=int(obj["start"]),
            stop=int(obj["stop"]),
            counts=tuple(int(n) for n in obj["counts"]),
            digests=tuple(str(d) for d in obj["xxh3_128"]),
            nbytes=int(obj["nbytes"]),
        )
        size = os.stat(work / run_file(chunk)).st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (
        record.chunk != chunk
        or len(record.counts) != n_buckets
        or len(record.digests) != n_buckets
        or int(layout.piece_offsets(record.counts)[-1]) != record.nbytes
        or size != record.nbytes
    ):
        return None
    return record


def write_record(work: Path, record: RunRecord, durable: bool) -> None:
    import orjson

    write_file_atomic(
        work / run_record_file(record.chunk), orjson.dumps(record.to_json()), durable, note=RUN_DISK_FULL_NOTE
    )


def write_run_data(path: Path, data: memoryview) -> int:
    """Write ``data`` (page-aligned) to ``path``: whole 4 KiB blocks with O_DIRECT where the
    filesystem allows it (the disk's sequential rate, no page-cache pollution), `DIRECT_IN_FLIGHT`
    requests at a time (`fileio.pwrite_direct`: a request O_DIRECT refuses, and the tail, go
    through the page cache). Returns the file's descriptor, still open: `sync_run` makes it
    durable and closes it (an fsync through the descriptor that wrote sees every write error).

    A full disk raises `DiskFullError` naming ``path``; on any error the unfinished run
    file is removed (it has no record, so it would only hold space)."""
    try:
        with naming_disk_full(path, data.nbytes, RUN_DISK_FULL_NOTE):
            return _write_run(path, data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def sync_run(path: Path, fd: int, nbytes: int, durable: bool) -> None:
    """fsync (when ``durable``) and close ``fd``, the run at ``path`` of ``nbytes`` as `write_run_data`
    left it; on any error the run file is removed."""
    try:
        with naming_disk_full(path, nbytes, RUN_DISK_FULL_NOTE):
            try:
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


#: What to do when a run does not fit, said in the `DiskFullError`.
RUN_DISK_FULL_NOTE = (
    "; free some space (or put the scratch runs on another disk: --work-dir) and run the shuffle again: "
    "it resumes after the last sealed run"
)


def _write_run(path: Path, data: memoryview) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    direct_fd = None
    try:
        direct_fd = open_direct(path) if data.nbytes >= DIRECT_ALIGN else None
        offsets = range(0, data.nbytes, DIRECT_WRITE)
        with ThreadPoolExecutor(DIRECT_IN_FLIGHT, "saev-shuffle-run") as pool:
            list(pool.map(lambda off: pwrite_direct(direct_fd, fd, data[off : off + DIRECT_WRITE], off), offsets))
    except BaseException:
        os.close(fd)
        raise
    finally:
        if direct_fd is not None:
            os.close(direct_fd)
    return fd


class Buffers:
    """The large buffers of one process's shuffle, carved from one mapping that both passes reuse.

    Fresh memory is faulted in page by page, each zeroed by the kernel first: a pass that
    allocated its own buffers (a quarter-gigabyte under a 256 MiB budget) paid for that
    again after the scatter pass had freed as much, and several times more than the
    zeroing itself in a virtual machine whose host backs freed guest memory lazily. The
    write pass carves its buckets and batches from the mapping the scatter pass carved its
    read and run buffers from (a larger one replaces it when it needs more).
    """

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None

    def carve(self, sizes: Sequence[int]) -> list[memoryview]:
        """One view of ``sizes[i]`` bytes each, page-aligned (O_DIRECT), none overlapping; views
        from an earlier call must no longer be in use."""
        starts = []
        total = 0
        for n in sizes:
            starts.append(total)
            total += -(-int(n) // DIRECT_ALIGN) * DIRECT_ALIGN
        if self._mm is None or len(self._mm) < total:
            self.close()
            self._mm = aligned_buffer(total)
        elif len(self._mm) > total and hasattr(mmap, "MADV_DONTNEED"):
            # What this call does not use is given back (the budget counts each pass alone).
            with contextlib.suppress(OSError):
                self._mm.madvise(mmap.MADV_DONTNEED, total, len(self._mm) - total)
        whole = memoryview(self._mm)
        return [whole[a : a + int(n)] for a, n in zip(starts, sizes, strict=True)]

    def close(self) -> None:
        """Unmap the buffers (left to the garbage collector while a view is still held, e.g. by
        a read abandoned after an error)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
