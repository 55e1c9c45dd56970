"""Units: the verifiable pieces a remote cache is read in, and how a process holds them.

A unit is a block of blocks.json (protocol 3.1: each with its own xxh3_128 digest), or, for a
cache without blocks.json, a whole file (its digest is the only one the manifest has). A unit
is taken from the block cache (`blockcache`, checked on open) or fetched with a ranged
request into a buffer of this process's pool, its length and digest compared with the
manifest, and only then copied out: no byte reaches the caller unchecked. A unit that arrives
short or damaged is fetched again (`VERIFY_ATTEMPTS` in all, with backoff); one that never
matches raises `ChecksumMismatchError` naming the block.

The block cache is best effort: a verified block is served from memory at once and queued
for one writer thread, which stores it (O_DIRECT where the disk allows it) while the reads
go on; when `MAX_PENDING_WRITES` bytes already wait, the block is not stored (counted in
``skipped``): the disk never slows the reads, and a later read of that block fetches it
again and stores it then. Concurrent reads of one unit wait for a single fetch.

`UnitReads` is the part of `remote.RemoteFiles` that does this (its units, held, fetched,
verified, stored); `remote` adds the `Files` interface over it.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import (
    ChecksumMismatchError,
    FileSizeError,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteError,
    RemoteRegionError,
    RemoteTimeoutError,
)
from ..fileio import aligned_buffer, pwrite_all
from .blockcache import BlockCache
from .client import TIMEOUT_ENV, Client, allowance, requests_in_flight, timeout
from .transfer import StreamDigest

#: Fetches of one unit before a mismatch is reported (each after a longer wait).
VERIFY_ATTEMPTS = 4
#: First wait before fetching a mismatching unit again (doubles each time).
VERIFY_BACKOFF = 0.2
#: Units whose descriptors a process keeps open, and bytes it keeps in memory (units just
#: fetched, until the reads holding them are done; units the block cache could not store).
MAX_OPEN = 256
MAX_MEMORY = 512 << 20
#: Bytes of fetched blocks waiting to be written to the block cache by the background writer;
#: a block fetched while this many wait is not stored (best effort: see the module docstring).
MAX_PENDING_WRITES = 256 << 20
#: Bytes per piece when a whole file is streamed (verify, whole-file units).
STREAM_CHUNK = 8 << 20

#: Refusals a new request would get again (the others are worth a new attempt).
_FINAL = (RemoteCredentialsError, RemoteAccessDeniedError, RemoteBucketError, RemoteRegionError)


@dataclass(frozen=True)
class Unit:
    """A verifiable piece of a file: bytes ``[start, start + nbytes)`` whose digest is ``digest``."""

    name: str
    key: str
    digest: str
    start: int
    nbytes: int
    #: Block index in blocks.json, or -1 for a whole file.
    block: int


class _Entry:
    """A unit this process holds: its bytes (with the pool they go back to once no read holds
    them and no write waits for them), a descriptor of its block cache entry, or both (a
    block this process fetched and then stored: read from memory until its memory is let go
    of, then through the descriptor, never checked again since this process wrote it)."""

    __slots__ = ("buffer", "closed", "data", "fd", "pool", "users")

    def __init__(self, fd: int | None, data: Any = None, pool: _Pool | None = None, buffer: Any = None) -> None:
        self.fd = fd
        self.data = data
        self.pool = pool
        self.buffer = buffer
        self.users = 0
        self.closed = False

    @property
    def nbytes_in_memory(self) -> int:
        return 0 if self.data is None else memoryview(self.data).nbytes

    def close(self) -> None:
        self.closed = True
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.drop_memory()

    def drop_memory(self) -> None:
        self.data = None
        if self.pool is not None:
            self.pool.give(self.buffer)
            self.pool = self.buffer = None


class _Pool:
    """Page-aligned buffers of one size that fetched blocks land in, handed out again as soon
    as their block is let go of: touching fresh memory costs more than the copy into it (page
    faults, pages zeroed), and aligned memory is what O_DIRECT writes need.

    A buffer's pages are faulted in as far as blocks have filled it, and blocks are not all
    of one size (a file's last one is shorter): `take` hands out a buffer already faulted in
    as far as the block needs where one is free, so that a buffer first filled by a short
    block is not then filled by full ones, faulting in fresh pages each time (a reader's first
    cold epochs cost a fifth more CPU here that way), and no page is faulted in that no block
    needs (faulting a whole buffer in when made cost a new process more: fresh memory).

    Free buffers are kept while the bytes they have faulted in come to at most ``keep_bytes``:
    bytes, not buffers, because that is what the units a process holds are bounded by, and a
    file's short last blocks fill only part of a buffer (counted in buffers, a cache of 38 MB
    files kept too few, and every cold epoch faulted in a fifth of its bytes afresh)."""

    def __init__(self, nbytes: int, keep_bytes: int) -> None:
        self.nbytes = nbytes
        self.keep_bytes = keep_bytes
        #: Free buffers, the last given back last, each with how far it has been filled.
        self._free: list[tuple[mmap.mmap, int]] = []
        self._free_bytes = 0  # how far the free buffers have been filled, together
        self._filled: dict[int, int] = {}  # id of a buffer handed out -> how far it was filled
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """A buffer for a block of ``nbytes``: the last given back of those filled that far
        already, else the one filled furthest, else a new one."""
        with self._lock:
            best = -1
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i][1] >= nbytes:
                    best = i
                    break
                if best < 0 or self._free[i][1] > self._free[best][1]:
                    best = i
            if best >= 0:
                buffer, filled = self._free.pop(best)
                self._free_bytes -= filled
            else:
                buffer, filled = aligned_buffer(self.nbytes), 0
            self._filled[id(buffer)] = max(filled, nbytes)
            return buffer

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            filled = self._filled.pop(id(buffer), self.nbytes)
            if self._free_bytes + filled <= self.keep_bytes:
                self._free.append((buffer, filled))
                self._free_bytes += filled
                return
        _unmap(buffer)

    def clear(self) -> None:
        with self._lock:
            free, self._free, self._free_bytes = self._free, [], 0
        for buffer, _ in free:
            _unmap(buffer)


def _unmap(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view of it still alive: the collector frees it
        buffer.close()


class UnitReads:
    """The units one process holds of a remote cache, fetched and verified (module docstring)."""

    client: Client
    cache: BlockCache
    block_size: int | None

    if TYPE_CHECKING:

        @property
        def location(self) -> str: ...

        def where(self, name: str) -> str: ...

    def _reset_units(self) -> None:
        self._held: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._inflight: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writing_bytes = 0
        self._buffers: _Pool | None = None
        #: Units fetched again because what came did not match (for reports and tests).
        self.refetched = 0
        #: Blocks fetched and verified but not stored in the block cache, and their bytes:
        #: `MAX_PENDING_WRITES` bytes were waiting for the disk (the cache is best effort).
        self.skipped = 0
        self.skipped_bytes = 0

    def _stop_units(self, wait: bool) -> None:
        """Let go of every unit, stop the fetch threads and (``wait``: after its writes) the writer."""
        self.let_go()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.flush(wait)
        if self._buffers is not None:
            self._buffers.clear()

    def let_go(self) -> None:
        """Let go of every unit this process holds (the next reads take them from the block
        cache or fetch them again), keeping the threads and buffers for those reads."""
        with self._lock:
            held, self._held = list(self._held.values()), collections.OrderedDict()
            for entry in held:
                if entry.users == 0:
                    entry.close()
                else:
                    entry.closed = True  # closed by the last `_release`

    def flush(self, wait: bool = True) -> None:
        """Wait until every unit fetched so far is written to the block cache (``wait=False``:
        stop taking new writes and let the queued ones finish on their thread)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=wait)

    def _warm(self, units: list[Unit], wait: bool = True) -> None:
        """Fetch the units neither held nor being fetched yet, several at once (``wait``: until
        those are there; one being fetched already is waited for by the read that needs it,
        `_acquire`, not by a fetch thread kept from fetching another)."""
        with self._lock:
            todo = [u for u in units if u.key not in self._held and u.key not in self._inflight]
            if self._pool is None and todo:
                self._pool = ThreadPoolExecutor(requests_in_flight(), thread_name_prefix="saev-remote")
            pool = self._pool
        if not todo or pool is None:
            return
        futures = [pool.submit(self._hold, u) for u in todo]
        if wait:
            for f in futures:
                f.result()

    def _hold(self, unit: Unit) -> None:
        self._release(self._acquire(unit))

    def _acquire(self, unit: Unit) -> _Entry:
        """The entry of ``unit``, held (`_release` it): from this process, the block cache, or fetched."""
        while True:
            with self._lock:
                entry = self._held.get(unit.key)
                if entry is not None:
                    self._held.move_to_end(unit.key)
                    entry.users += 1
                    return entry
                future = self._inflight.get(unit.key)
                owner = future is None
                if future is None:
                    future = self._inflight[unit.key] = Future()
            if not owner:
                future.result()  # raises what the fetch raised
                continue
            try:
                entry = self._load(unit)
            except BaseException as err:
                with self._lock:
                    del self._inflight[unit.key]
                future.set_exception(err)
                raise
            with self._lock:
                self._held[unit.key] = entry
                entry.users += 1
                del self._inflight[unit.key]
                self._shrink()
            future.set_result(None)
            return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.closed and entry.users == 0:
                entry.close()

    def _shrink(self) -> None:
        """Let go of the least recently used units no read holds (lock held): of the memory of
        one also held by a descriptor, and of the others entirely."""
        memory = sum(e.nbytes_in_memory for e in self._held.values())
        for key in list(self._held):
            if len(self._held) <= MAX_OPEN and memory <= MAX_MEMORY:
                return
            entry = self._held[key]
            if entry.users:
                continue
            memory -= entry.nbytes_in_memory
            if entry.fd is not None and len(self._held) <= MAX_OPEN:
                entry.drop_memory()
                continue
            del self._held[key]
            entry.close()

    def _load(self, unit: Unit) -> _Entry:
        """``unit`` from the block cache, else fetched until its length and digest match:
        `VERIFY_ATTEMPTS` fetches at most, none started once `client.allowance` has passed
        (a unit dripped in, or a server that keeps failing, is given up in bounded time)."""
        fd = self.cache.open(unit.key, unit.nbytes, unit.digest)
        if fd is not None:
            return _Entry(fd)
        problems: list[str] = []
        failure: RemoteError | None = None
        allowed = allowance(unit.nbytes)
        deadline = time.monotonic() + allowed
        fetches = 0
        for attempt in range(VERIFY_ATTEMPTS):
            if attempt:
                wait = VERIFY_BACKOFF * 2 ** (attempt - 1)
                if time.monotonic() + wait >= deadline:
                    break
                self.refetched += 1
                time.sleep(wait)
            fetches += 1
            try:
                result = self._fetch_file(unit) if unit.block < 0 else self._fetch_block(unit)
            except RemoteError as err:
                if isinstance(err, _FINAL):  # no point asking again: the same answer would come
                    raise
                failure = err  # the server failed even after the client's own retries
                continue
            if isinstance(result, _Entry):
                return result
            problems.append(result)
        if isinstance(failure, RemoteTimeoutError) or (failure is not None and fetches < VERIFY_ATTEMPTS):
            last = "" if isinstance(failure, RemoteTimeoutError) else f"; the last one: {failure}"
            raise RemoteTimeoutError(
                f"{self.where(unit.name)}: {describe(unit)} did not arrive within {allowed:g} s "
                f"({_fetches(fetches)}; ${TIMEOUT_ENV}: {timeout():g} s per 16 MiB): the server is stalled or "
                f"too slow (on a slow link, raise {TIMEOUT_ENV}){last}"
            )
        if not problems and failure is not None:
            raise failure
        raise ChecksumMismatchError(
            f"{self.where(unit.name)}: {describe(unit)} does not match the manifest after {_fetches(fetches)} "
            f"({'; '.join(dict.fromkeys(problems))}): the remote copy is damaged (check it with "
            f"`saev-shards verify {self.location}`)"
        )

    def _buffer_pool(self) -> _Pool:
        with self._lock:
            if self._buffers is None:
                assert self.block_size is not None  # blocks are units only with a block size
                # Enough for what a process may hold: units in memory, writes waiting, fetches.
                keep = MAX_MEMORY + MAX_PENDING_WRITES + requests_in_flight() * self.block_size
                self._buffers = _Pool(self.block_size, keep)
            return self._buffers

    def _fetch_block(self, unit: Unit) -> _Entry | str:
        """Fetch a block into a buffer of the pool; served from there once its length and digest
        match, and queued for the block cache (`_store_later`)."""
        pool = self._buffer_pool()
        buffer = pool.take(unit.nbytes)
        try:
            view = memoryview(buffer)[: unit.nbytes]
            hasher = xxhash.xxh3_128()  # each piece hashed as it lands, while in the cache
            got = self.client.read_into(unit.name, unit.start, view, hasher)
            found = hasher.hexdigest() if got == unit.nbytes else ""
        except BaseException:
            pool.give(buffer)
            raise
        if found != unit.digest:
            pool.give(buffer)
            return _mismatch(unit, got, found)
        entry = _Entry(None, view, pool, buffer)
        self._store_later(unit.key, entry)
        return entry

    def _store_later(self, key: str, entry: _Entry) -> None:
        """Queue a verified block for the writer thread, so that a read never waits for the
        disk; skip it (counted in `skipped`) when `MAX_PENDING_WRITES` bytes already wait. Not
        at all when the block cache is disabled or its writes paused (a full disk)."""
        nbytes = entry.nbytes_in_memory
        if self.cache.disabled or self.cache.paused:
            return
        with self._lock:
            if self._writing_bytes + nbytes > MAX_PENDING_WRITES:
                self.skipped += 1
                self.skipped_bytes += nbytes
                return
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="saev-remote-cache")
            self._writing_bytes += nbytes
            entry.users += 1  # its bytes stay until written
            self._writer.submit(self._write_entry, key, entry, nbytes)

    def _write_entry(self, key: str, entry: _Entry, nbytes: int) -> None:
        try:
            fd = self.cache.insert(key, entry.data)
            if fd is not None:
                with self._lock:  # kept: read through it once the entry's memory is let go of
                    if entry.closed or entry.fd is not None:
                        os.close(fd)
                    else:
                        entry.fd = fd
        except OSError as err:  # the block cache is an optimisation: say so once, keep reading
            self.cache.pause_writes(err)
        finally:
            with self._lock:
                self._writing_bytes -= nbytes
            self._release(entry)

    def _fetch_file(self, unit: Unit) -> _Entry | str:
        """A whole file, streamed into a temporary entry of the block cache while hashed (never
        more than one byte past its size: `Client.stream`); into memory when the block cache
        is disabled or cannot be written (a full disk: one warning)."""
        if self.cache.disabled or self.cache.paused:
            return self._fetch_into_memory(unit)
        try:
            with self.cache.writing(unit.key) as tmp:
                seen = StreamDigest()
                for view in seen.through(self.client.stream(unit.name, 0, unit.nbytes, STREAM_CHUNK)):
                    pwrite_all(tmp.fd, view, seen.nbytes - view.nbytes)
                if seen.nbytes != unit.nbytes or seen.digest != unit.digest:
                    return _mismatch(unit, seen.nbytes, seen.digest)  # the temporary entry is removed
                return _Entry(self.cache.commit(tmp))
        except OSError as err:
            if isinstance(err, RemoteError):  # the server's, not the disk's
                raise
            self.cache.pause_writes(err)
        return self._fetch_into_memory(unit)

    def _fetch_into_memory(self, unit: Unit) -> _Entry | str:
        data = bytearray(unit.nbytes)
        got = self.client.read_into(unit.name, unit.start, memoryview(data))
        found = xxhash.xxh3_128_hexdigest(data) if got == unit.nbytes else ""
        return _Entry(None, data) if found == unit.digest else _mismatch(unit, got, found)


def _fetches(n: int) -> str:
    return f"{n} fetch" + ("" if n == 1 else "es")


def _mismatch(unit: Unit, got: int, found: str) -> str:
    if got != unit.nbytes:
        return f"{got} bytes came instead of {unit.nbytes}"
    return f"xxh3_128 {found} instead of {unit.digest}"


def copy_out(entry: _Entry, dest: memoryview, offset: int) -> None:
    """Copy ``dest.nbytes`` bytes of ``entry`` from ``offset`` into ``dest``."""
    if entry.data is not None:
        dest[:] = memoryview(entry.data).cast("B")[offset : offset + dest.nbytes]
        return
    assert entry.fd is not None
    while dest.nbytes:
        n = os.preadv(entry.fd, [dest], offset)
        if n == 0:
            raise FileSizeError(f"block cache entry ended early at byte {offset} (removed while read?)")
        dest = dest[n:]
        offset += n


def describe(unit: Unit) -> str:
    """``block 7 (bytes 117440512-134217727)``, or ``the whole file`` for a whole-file unit."""
    if unit.block < 0:
        return "the whole file"
    return f"block {unit.block} (bytes {unit.start}-{unit.start + unit.nbytes - 1})"
