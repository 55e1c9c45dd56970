"""`RemoteFiles`: the storage of a cache in an object store or on an HTTP server.

The reader reads a local cache through descriptors (``os.open``, ``os.preadv``); a remote
cache gives it this object instead, with the same calls (the whole `base.Files` interface),
so every read path of `Shards` (indexing, `read_example`, `read_range`, `read_vectors`, the
loaders, the shuffle), `verify` and the transfers work on both.

A read is served in *units* (`units`: blocks of blocks.json, or whole files), each checked
against the manifest's digests before a byte of it is handed out, kept in memory and in the
block cache (`blockcache`) for the next reads. Requests in flight: a read needing several
units fetches them in parallel, and `prefetch` (called by the loaders for every window they
are about to read into buffers, not for one read in place) starts the fetches of whole
windows on a pool of `client.requests_in_flight` threads.
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    FileSizeError,
    InvalidCacheError,
    JSONFileError,
    Problem,
)
from ..protocol.jsonfile import strict_json_loads
from .base import Digests, Files, Piece
from .blockcache import BlockCache
from .client import Client, requests_in_flight
from .local import FolderLock
from .transfer import StreamDigest
from .units import STREAM_CHUNK, Unit, UnitReads, copy_out
from .url import join_url, split_url, strip


class RemoteFiles(UnitReads, Files):
    """The data files of one remote cache (module docstring). Pickles without connections,
    descriptors or threads; each process opens its own.

    ``folder``: the local folder its JSON files were fetched into (`remote_json.local_folder`)."""

    mappable = False
    in_place = True
    prefetches = True
    verifies_reads = True
    #: Earlier name of ``not mappable``.
    copies = True

    def __init__(
        self,
        url: str,
        files: Mapping[str, tuple[int, str | None]],
        cache: BlockCache,
        folder: Path | None = None,
    ) -> None:
        self._url = strip(url)
        self.client = Client(self._url)
        self.cache = cache
        self.files = dict(files)
        self.folder = folder
        self.block_size: int | None = None
        self.block_digests: Callable[[str], list[str] | None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        self._kept: dict[str, bytes] = {}  # whole files read for `open_file`
        self._reset_units()

    def __getstate__(self) -> dict[str, Any]:
        keep = ("_url", "client", "cache", "files", "folder", "block_size", "block_digests")
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

    # -- what it can do, where things are ----------------------------------------------------
    @property
    def streams(self) -> int:
        return requests_in_flight()

    def per_block(self, name: str) -> bool:
        return self._digests_of(name) is not None

    def _digests_of(self, name: str) -> list[str] | None:
        """``name``'s block digests, None for a file without (blocks.json itself, a 3.0 cache)."""
        if self.block_digests is None:
            return None
        try:
            return self.block_digests(name)
        except KeyError:  # a listed file blocks.json has no digests of: blocks.json itself
            return None

    @property
    def url(self) -> str:
        return self._url

    @property
    def location(self) -> str:
        return self._url

    def where(self, name: str) -> str:
        return f"{self._url}/{name}"

    def beside(self, name: str) -> str:
        return join_url(split_url(self._url)[0], name)

    @property
    def local_root(self) -> None:
        return None

    def footprint(self) -> int:
        """Bytes of its objects: the data files the manifest lists, and its JSON files."""
        data = sum(nbytes for nbytes, _ in self.files.values())
        if self.folder is None:
            return data
        return data + sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())

    def share_beside(self, name: str, data: bytes) -> None:
        Client(split_url(self._url)[0]).put(name, data)

    def lock_folder(self) -> FolderLock | None:
        return None  # no folder of its data to lock: the local one holds only JSON files

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
        self._kept.clear()
        self._stop_units(wait)

    def preadv(self, fd: int, views: Sequence[memoryview], offset: int, /) -> int:
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
                    copy_out(entry, dest[:n], pos - unit.start)
                    pos += n
                    done += n
                    queue[0] = dest[n:]
                    if not queue[0].nbytes:
                        queue.pop(0)
            finally:
                self._release(entry)
        return done

    def prefetch(self, fd: int, start: int, stop: int, *, scattered: bool = False) -> None:
        """Start fetching the units of bytes ``[start, stop)`` of the file behind ``fd`` in the
        background (scattered reads or not: the units are what is fetched)."""
        self._check_pid()
        name = self._names[fd]
        stop = min(stop, self.files[name][0])
        if stop > start:
            self._warm(self.units(name, start, stop), wait=False)

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

    # -- files read in place -----------------------------------------------------------------
    def map_pieces(self, name: str, nbytes: int) -> list[Piece] | None:
        """The block cache's entries of the units holding the first ``nbytes`` of ``name``, each
        checked as `BlockCache.open` checks it (its seal, else its digest); None when one
        is not there (not fetched yet, trimmed, a block cache of size 0): nothing is fetched here.
        Blocks are powers of two of at least 64 KiB (protocol 3.1), so each lands on a page."""
        self._check_pid()
        pieces: list[Piece] = []
        try:
            for unit in self.units(name, 0, nbytes) if nbytes else []:
                fd = (
                    None
                    if unit.start % mmap.ALLOCATIONGRANULARITY
                    else self.cache.open(unit.key, unit.nbytes, unit.digest)
                )
                if fd is None:  # not fetched yet, trimmed, or off a page: read into buffers
                    for held, _, _ in pieces:
                        os.close(held)
                    return None
                pieces.append((fd, unit.start, min(unit.nbytes, nbytes - unit.start)))
        except BaseException:
            for fd, _, _ in pieces:
                os.close(fd)
            raise
        return pieces

    def pieces_of(self, nbytes: int) -> int:
        """One per block (one per file for a cache verified per whole file)."""
        return 1 if self.block_size is None else max(1, -(-nbytes // self.block_size))

    def size_now(self, fd: int) -> int:
        return self.files[self._names[fd]][0]

    # -- whole files ---------------------------------------------------------------------------
    def map(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any] | None:
        return None  # nothing to map: `load` reads it whole, `RemoteShard` in runs of examples

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        """Bytes ``[start, stop)`` of ``name`` (verified), as a new buffer."""
        size = self.files[name][0]
        stop = size if stop is None else min(stop, size)
        out = bytearray(max(0, stop - start))
        got = self.preadv(self.open(name), [memoryview(out)], start)
        if got != len(out):
            raise FileSizeError(f"{self.where(name)}: expected {len(out)} bytes at {start}, found {got}")
        return out

    def open_file(self, name: str) -> io.BytesIO:
        """The file read whole (verified) on first use, then kept until `close_all`."""
        self._check_pid()
        data = self._kept.get(name)
        if data is None:
            data = self._kept[name] = bytes(self.read(name))
        return io.BytesIO(data)

    def read_json(
        self, name: str, max_bytes: int, kind: type[InvalidCacheError], *, every_number: bool = True
    ) -> tuple[Any, list[Problem]]:
        """A data file (stats.json) read through the verified reads; metadata.json and the other
        files the manifest does not list fetched again from the server."""
        where = self.where(name)
        if name in self.files:
            nbytes = self.files[name][0]
            if nbytes > max_bytes:
                return None, [Problem(kind, f"{where}: expected at most {max_bytes:,} bytes, found {nbytes:,}")]
            data = bytes(self.read(name))
        else:
            try:
                data = self.client.get_bytes(name, max_bytes)
            except FileNotFoundError:
                return None, [Problem(CacheNotFoundError, f"{where}: missing")]
            except JSONFileError as err:
                return None, [_worded(kind, where, err)]
        try:
            return strict_json_loads(data, every_number=every_number), []
        except JSONFileError as err:
            return None, [_worded(kind, where, err)]

    def stream(self, name: str, start: int = 0, stop: int | None = None) -> Iterator[memoryview]:
        """Straight from the server (not checked, not cached: the caller hashes them), to the size
        the manifest gives ``name`` by default, whatever the server sends."""
        if name not in self.files:
            raise FileNotFoundError(f"{self.where(name)}: not a data file of this cache")
        end = self.files[name][0] if stop is None else stop
        return self.client.stream(name, start, end, STREAM_CHUNK)

    def verify_file(self, name: str, block_size: int | None, tick: Callable[[int], None]) -> Digests:
        """From the server, not from the block cache; at most one byte past its size is read:
        a longer body counts one byte too many."""
        try:
            seen = StreamDigest(tick, block_size).drain(self.stream(name))
        except FileNotFoundError:
            raise CacheNotFoundError(f"{self.where(name)}: missing") from None
        return seen.nbytes, seen.digest, seen.block_digests()


def _worded(kind: type[InvalidCacheError], where: str, err: JSONFileError) -> Problem:
    text = str(err)
    return Problem(kind, text if text.startswith(where) else f"{where}: {text}")
