"""The O_DIRECT sequential file the writer writes shards through, and its buffer pool.

Everything here is about getting bytes to the disk at its sequential rate; what the
bytes mean is the caller's business (`saev_shards.writer.streams`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..fileio import DIRECT_ALIGN, aligned_buffer, open_direct, pwrite_all

#: O_DIRECT write size for shard files (a multiple of `fileio.DIRECT_ALIGN`).
DIRECT_BLOCK = 16 << 20
#: O_DIRECT writes in flight per file: the next block is copied and hashed meanwhile.
DIRECT_IN_FLIGHT = 2


class SequentialFile:
    """A file written front to back, through O_DIRECT where the filesystem allows it.

    Whole aligned blocks go to the disk with O_DIRECT from aligned staging buffers: on
    this kind of machine that runs at the disk's sequential rate, while page-cache writes
    flushed by a final fsync reach about half of it (memory copy and writeback end up
    serialised) and evict what readers had cached. The blocks are written by a small
    thread pool, up to `DIRECT_IN_FLIGHT` at once, so copying and hashing the next block
    overlaps the disk. The unaligned tail goes through the page cache. Where O_DIRECT is
    refused (tmpfs, some network filesystems) every write is buffered and synchronous.
    """

    def __init__(self, path: Path, direct: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct_fd = open_direct(path) if direct else None
        # One buffer being filled plus one per write in flight, rotated.
        count = DIRECT_IN_FLIGHT + 1 if self.direct_fd is not None else 0
        self.buffers = [_take_buffer() for _ in range(count)]
        self.current = 0
        self.in_flight: collections.deque[Future[None]] = collections.deque()
        self.fill = 0
        self.offset = 0  # file offset of the current buffer's first byte

    def fileno(self) -> int:
        return self.fd

    def write(self, view: memoryview) -> None:
        if not self.buffers:
            pwrite_all(self.fd, view, self.offset)
            self.offset += view.nbytes
            return
        while view.nbytes:
            n = min(DIRECT_BLOCK - self.fill, view.nbytes)
            self.buffers[self.current][self.fill : self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == DIRECT_BLOCK:
                self._submit(DIRECT_BLOCK)

    def _submit(self, nbytes: int) -> None:
        """Hand the current buffer's first ``nbytes`` (a multiple of DIRECT_ALIGN) to the pool."""
        while len(self.in_flight) >= DIRECT_IN_FLIGHT:
            self.in_flight.popleft().result()  # frees the buffer we rotate to next
        buffer = self.buffers[self.current]
        self.in_flight.append(_direct_pool().submit(self._write_direct, buffer, nbytes, self.offset))
        self.offset += nbytes
        self.fill = 0
        self.current = (self.current + 1) % len(self.buffers)

    def _write_direct(self, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
        assert self.direct_fd is not None
        with memoryview(buffer) as whole:
            done = 0
            while done < nbytes:
                try:
                    done += os.pwrite(self.direct_fd, whole[done:nbytes], offset + done)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    # An unaligned remainder after a short write: finish through the page cache.
                    pwrite_all(self.fd, whole[done:nbytes], offset + done)
                    done = nbytes

    def close(self, durable: bool) -> None:
        try:
            if self.buffers:
                rest = self.fill
                aligned = rest - rest % DIRECT_ALIGN
                buffer = self.buffers[self.current]
                if aligned:
                    tail = bytes(buffer[aligned:rest])
                    self._submit(aligned)
                    self.fill = rest = len(tail)
                    self.buffers[self.current][:rest] = tail
                while self.in_flight:
                    self.in_flight.popleft().result()
                with memoryview(self.buffers[self.current]) as whole:
                    pwrite_all(self.fd, whole[:rest], self.offset)
                self.offset += rest
                self.fill = 0
            if durable:
                os.fsync(self.fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        while self.in_flight:  # never free a buffer a pool thread is still writing from
            with contextlib.suppress(BaseException):
                self.in_flight.popleft().result()
        for fd in (self.direct_fd, self.fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self.direct_fd = -1
        for buffer in self.buffers:
            _give_buffer(buffer)
        self.buffers = []


# Aligned buffers are reused from file to file: first-touch page faults on fresh
# anonymous memory cost more than the copy itself here (48 MiB per shard file).
_FREE_BUFFERS: dict[int, list[mmap.mmap]] = {}
_MAX_FREE_BUFFERS = DIRECT_IN_FLIGHT + 1  # one file's worth, released when a writer closes


def _take_buffer() -> mmap.mmap:
    free = _FREE_BUFFERS.setdefault(os.getpid(), [])  # per process: never share across fork
    while free:
        buffer = free.pop()
        if len(buffer) == DIRECT_BLOCK:
            return buffer
        buffer.close()
    return aligned_buffer(DIRECT_BLOCK)


def _give_buffer(buffer: mmap.mmap) -> None:
    free = _FREE_BUFFERS.setdefault(os.getpid(), [])
    if len(free) < _MAX_FREE_BUFFERS:
        free.append(buffer)
    else:
        buffer.close()


def release_buffers() -> None:
    """Return the kept buffers' memory to the system."""
    for buffer in _FREE_BUFFERS.pop(os.getpid(), []):
        buffer.close()


_DIRECT_POOLS: dict[int, ThreadPoolExecutor] = {}


def _direct_pool() -> ThreadPoolExecutor:
    """Threads that issue O_DIRECT writes, shared by the files written in this process.

    Keyed by pid: a forked child must not use its parent's pool, whose threads it lacks.
    """
    pid = os.getpid()
    pool = _DIRECT_POOLS.get(pid)
    if pool is None:  # setdefault is atomic; a losing racer's pool never starts a thread
        pool = _DIRECT_POOLS.setdefault(pid, ThreadPoolExecutor(DIRECT_IN_FLIGHT, "saev-shards-direct-io"))
    return pool
