"""`RemoteFiles`: the reader's storage for a cache in an object store or on an HTTP server.

The reader reads a local cache through descriptors (``os.open``, ``os.preadv``); a remote
cache gives it this object instead, with the same three calls (`open`, `preadv`, `close`),
so every read path of `Shards` (indexing, `read_example`, `read_range`, `read_vectors`, the
loaders, the shuffle) works on both.

A read is served in *units*: the blocks of blocks.json (protocol 3.1: each with its own
xxh3_128 digest), or, for a cache without blocks.json, the whole file (its digest is the
only one the manifest has). A unit is taken from the block cache (`blockcache`, checked on
open) or fetched with a ranged request into a buffer of this process's pool, its length and
digest compared with the manifest, and only then copied out: no byte reaches the caller
unchecked. A unit that arrives short or damaged is fetched again (`VERIFY_ATTEMPTS` in
all, with backoff); one that never matches raises `ChecksumMismatchError` naming the block.

The block cache is best effort: a verified block is served from memory at once and queued
for one writer thread, which stores it (O_DIRECT where the disk allows it) while the reads
go on; when `MAX_PENDING_WRITES` bytes already wait, the block is not stored (counted in
`RemoteFiles.skipped`): the disk never slows the reads, and a later read of that block
fetches it again and stores it then.

Requests in flight: a read needing several units fetches them in parallel, and `prefetch`
(called by the loaders for every window they are about to read) starts the fetches of
whole windows on a pool of `client.requests_in_flight` threads; concurrent reads of one
unit wait for a single fetch.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import (
    CacheNotFoundError,
    CacheRefError,
    ChecksumMismatchError,
    FileSizeError,
    InvalidCacheError,
    JSONFileError,
    NotRegularFileError,
    Problem,
    RemoteAccessDeniedError,
    RemoteBucketError,
    RemoteCredentialsError,
    RemoteError,
    RemoteRegionError,
    RemoteTimeoutError,
)
from ..fileio import BlockHasher, aligned_buffer, open_regular, pwrite_all, write_file_atomic
from ..protocol.jsonfile import strict_json_loads
from .blockcache import BlockCache, _Unwritable
from .client import TIMEOUT_ENV, Client, allowance, requests_in_flight, timeout
from .url import check_url, split_url, strip

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
    faults, pages zeroed), and aligned memory is what O_DIRECT writes need."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes = nbytes
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_buffer(self.nbytes)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)
                return
        _unmap(buffer)

    def clear(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buffer in free:
            _unmap(buffer)


def _unmap(buffer: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view of it still alive: the collector frees it
        buffer.close()


def fetch_json(client: Client, folder: Path, name: str, max_bytes: int, mode: int = 0o600) -> bool:
    """Download the JSON file ``name`` of the cache behind ``client`` into ``folder`` (atomically,
    as a file of ``mode``, never through a link); False, leaving no local copy, when the server
    has none. `JSONFileError` when it is larger than ``max_bytes`` (no more than ``max_bytes +
    1`` bytes of it are read); `blockcache._Unwritable` when ``folder`` cannot be written."""
    try:
        data = client.get_bytes(name, max_bytes)
    except RemoteBucketError:
        raise
    except FileNotFoundError:
        forget_json(folder, name)
        return False
    if _holds(folder / name, data):
        # Left in place: another process of this node may be reading this very file (a
        # published cache never changes, so the same URL gives the same bytes); replacing it
        # would swap the file under that reader between its lstat and its open.
        return True
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            write_file_atomic(folder / name, data, durable=False, dir_fd=fd, mode=mode)
        finally:
            os.close(fd)
    except OSError as err:
        raise _Unwritable(err) from None
    return True


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a regular file holding exactly ``data`` (never through a link)."""
    try:
        with open_regular(path) as f:
            return os.fstat(f.fileno()).st_size == len(data) and f.read(len(data) + 1) == data
    except (OSError, NotRegularFileError):
        return False


def forget_json(folder: Path, name: str) -> None:
    """Remove the local copy of ``name`` in ``folder`` (never through a link), if any."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
    except OSError as err:
        raise _Unwritable(err) from None
    finally:
        os.close(fd)


def refetch_json(
    files: RemoteFiles, name: str, max_bytes: int, kind: type[InvalidCacheError]
) -> tuple[Any, list[Problem]]:
    """The JSON file ``name`` read again from the server, under the strict rules of every JSON
    file of a cache: ``(value, [])``, or ``(None, [the problem, worded for kind])``."""
    where = files.where(name)
    try:
        return strict_json_loads(files.client.get_bytes(name, max_bytes)), []
    except FileNotFoundError:
        return None, [Problem(CacheNotFoundError, f"{where}: missing")]
    except JSONFileError as err:
        text = str(err)
        return None, [Problem(kind, text if text.startswith(where) else f"{where}: {text}")]


def local_folder(cache: BlockCache, url: str, memory: bool = False) -> Path:
    """Where the JSON files of the remote cache ``url`` are kept on this node (made, no link
    followed): ``<block cache>/roots/<id of its root>/<HASH>``, a folder laid out like a shards
    root, so the reader's checks of those files (and the statistics sidecar beside them) run as
    for a local cache; the same in `blockcache.memory_folder` with ``memory`` or when the block
    cache is disabled. The URL's segments are checked first (`url.check_url`: no ``..``)."""
    root, name = split_url(check_url(strip(url)))
    if not name:
        raise CacheRefError(f"{url}: expected the URL of a cache (<root>/<hash>), found a bucket or server alone")
    return cache.json_folder(root, name, memory)


class RemoteFiles:
    """The data files of one remote cache (module docstring). Pickles without connections,
    descriptors or threads; each process opens its own."""

    #: Reads return copies (a remote cache has no memory map to return views of).
    copies = True

    def __init__(self, url: str, files: Mapping[str, tuple[int, str | None]], cache: BlockCache) -> None:
        self.url = strip(url)
        self.client = Client(self.url)
        self.cache = cache
        self.files = dict(files)
        self.block_size: int | None = None
        self.block_digests: Callable[[str], list[str] | None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
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

    def __getstate__(self) -> dict[str, Any]:
        keep = ("url", "client", "cache", "files", "block_size", "block_digests")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's descriptors and threads are not ours
            self._reset()

    def use_blocks(self, block_size: int, digests: Callable[[str], list[str] | None]) -> None:
        """Verify per block: ``digests(name)`` gives a file's block digests (blocks.json)."""
        self.block_size = block_size
        self.block_digests = digests

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def per_block(self, name: str) -> bool:
        """Whether reads of ``name`` are verified per block (else per whole file)."""
        return self._digests_of(name) is not None

    def _digests_of(self, name: str) -> list[str] | None:
        """``name``'s block digests, None for a file without (blocks.json itself, a 3.0 cache)."""
        if self.block_digests is None:
            return None
        try:
            return self.block_digests(name)
        except KeyError:  # a listed file blocks.json has no digests of: blocks.json itself
            return None

    # -- the descriptor interface of the reader --------------------------------------------
    def open(self, name: str) -> int:
        """A small integer standing for ``name`` (what `preadv` takes); `FileNotFoundError` if
        the manifest does not list it."""
        self._check_pid()
        if name not in self.files:
            raise FileNotFoundError(f"{self.where(name)}: not a data file of this cache")
        with self._lock:
            fd = self._ids.get(name)
            if fd is None:
                fd = self._ids[name] = len(self._names)
                self._names.append(name)
        return fd

    def close(self, fd: int) -> None:
        return None  # nothing per file to release: units are held by key

    def close_all(self, wait: bool = True) -> None:
        """Release every held unit and stop the fetch threads (`Shards.close`); with ``wait``,
        wait for the block-cache writes too (`flush`), else they finish in the background."""
        if self._pid != os.getpid():
            self._reset()
            return
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

    def preadv(self, fd: int, views: Sequence[memoryview], offset: int) -> int:
        """Fill ``views`` in order from byte ``offset`` of the file behind ``fd`` (as ``os.preadv``:
        fewer bytes only at the end of the file); every byte verified first."""
        name = self._names[fd]
        size = self.files[name][0]
        total = sum(memoryview(v).nbytes for v in views)
        stop = min(size, offset + total)
        if stop <= offset:
            return 0
        units = self.units(name, offset, stop)
        if len(units) > 1:
            self._warm(units)
        done = 0
        pos = offset
        queue = [memoryview(v).cast("B") for v in views]
        for unit in units:
            entry = self._acquire(unit)
            try:
                while queue and pos < min(stop, unit.start + unit.nbytes):
                    dest = queue[0]
                    n = min(dest.nbytes, unit.start + unit.nbytes - pos, stop - pos)
                    _copy(entry, dest[:n], pos - unit.start)
                    pos += n
                    done += n
                    queue[0] = dest[n:]
                    if not queue[0].nbytes:
                        queue.pop(0)
            finally:
                self._release(entry)
        return done

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        """Bytes ``[start, stop)`` of ``name`` (verified), as a new buffer."""
        size = self.files[name][0]
        stop = size if stop is None else min(stop, size)
        out = bytearray(max(0, stop - start))
        got = self.preadv(self.open(name), [memoryview(out)], start)
        if got != len(out):
            raise FileSizeError(f"{self.where(name)}: expected {len(out)} bytes at {start}, found {got}")
        return out

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Start fetching the units of bytes ``[start, stop)`` of ``name`` in the background."""
        self._check_pid()
        size = self.files[name][0]
        stop = min(stop, size)
        if stop > start:
            self._warm(self.units(name, start, stop), wait=False)

    # -- units -------------------------------------------------------------------------------
    def units(self, name: str, start: int, stop: int) -> list[Unit]:
        """The units that hold bytes ``[start, stop)`` of ``name``, in order."""
        size, whole = self.files[name]
        digests = self._digests_of(name)
        if digests is None or self.block_size is None:
            if whole is None:
                raise ChecksumMismatchError(f"{self.where(name)}: the manifest records no digest for it")
            return [Unit(name, f"file-{whole}", whole, 0, size, -1)]
        bs = self.block_size
        first, last = start // bs, (max(start, stop - 1)) // bs
        return [Unit(name, digests[i], digests[i], i * bs, min(bs, size - i * bs), i) for i in range(first, last + 1)]

    def _warm(self, units: list[Unit], wait: bool = True) -> None:
        """Fetch the units not held yet, several at once (``wait``: until all are there)."""
        with self._lock:
            todo = [u for u in units if u.key not in self._held and (wait or u.key not in self._inflight)]
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
            f"`saev-shards verify {self.url}`)"
        )

    def _buffer_pool(self) -> _Pool:
        with self._lock:
            if self._buffers is None:
                assert self.block_size is not None  # blocks are units only with a block size
                # Enough for what a process may hold: units in memory, writes waiting, fetches.
                keep = (MAX_MEMORY + MAX_PENDING_WRITES) // self.block_size + requests_in_flight()
                self._buffers = _Pool(self.block_size, keep)
            return self._buffers

    def _fetch_block(self, unit: Unit) -> _Entry | str:
        """Fetch a block into a buffer of the pool; served from there once its length and digest
        match, and queued for the block cache (`_store_later`)."""
        pool = self._buffer_pool()
        buffer = pool.take()
        try:
            view = memoryview(buffer)[: unit.nbytes]
            got = self.client.read_into(unit.name, unit.start, view)
            found = xxhash.xxh3_128_hexdigest(view) if got == unit.nbytes else ""
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
                h = xxhash.xxh3_128()
                got = 0
                for chunk in self.stream(unit.name):
                    view = memoryview(chunk)
                    h.update(view)
                    pwrite_all(tmp.fd, view, got)
                    got += view.nbytes
                if got != unit.nbytes or h.hexdigest() != unit.digest:
                    return _mismatch(unit, got, h.hexdigest())  # the temporary entry is removed
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

    def stream(self, name: str, start: int = 0) -> Iterator[Any]:
        """The bytes of ``name`` from ``start`` to the size the manifest gives it, in order,
        straight from the server (not checked, not cached: the caller hashes them). Never more
        than one byte past that size, whatever the server sends."""
        return self.client.stream(name, start, self.files[name][0], STREAM_CHUNK)

    def verify_file(self, name: str, block_size: int | None, tick: Callable[[int], None]) -> tuple[int, str, list[str]]:
        """Read ``name`` from the server (not from the block cache): ``(bytes, xxh3_128 of the
        whole, xxh3_128 of each ``block_size`` bytes)`` (no block digests without a block size).
        At most one byte past its size is read: a longer body counts one byte too many."""
        hasher = BlockHasher(block_size)
        total = 0
        for chunk in self.stream(name):
            view = memoryview(chunk)
            hasher.update(view)
            tick(view.nbytes)
            total += view.nbytes
        return total, hasher.hexdigest(), hasher.block_hexdigests()


def _fetches(n: int) -> str:
    return f"{n} fetch" + ("" if n == 1 else "es")


def _mismatch(unit: Unit, got: int, found: str) -> str:
    if got != unit.nbytes:
        return f"{got} bytes came instead of {unit.nbytes}"
    return f"xxh3_128 {found} instead of {unit.digest}"


def _copy(entry: _Entry, dest: memoryview, offset: int) -> None:
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
