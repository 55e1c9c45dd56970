"""`Files`: everything the reader, the store and the transfers ask of the place a cache's
data files live, declared once.

Two storages implement all of it: `local.LocalFiles` (a folder on this machine:
descriptors, ``os.preadv``, memory maps, as always) and `remote.RemoteFiles` (an object
store or an HTTP server: ranged requests, every block checked against the manifest before
a byte of it is handed out). Callers never ask which one they hold; what differs between
the two is a method or a property here, with one meaning, that both implement (as zarr's
``Store`` ABC has every backend implement it whole). A third storage (an in-memory one for
tests, a read-only HTTP mirror) is one more module.

The calls, by what they are for:

* the descriptor interface of the reader's hot paths: `open`, `preadv`, `prefetch`, `close`
  (and `close_all`, when the cache is closed);
* files read in place: `map_pieces` (files of this machine to map, piece by piece, into one
  address range: `loaders.mapped`), `pieces_of` and `size_now`;
* whole files: `map` (a read-only memory map, where the storage can map files) and `load`
  (the same, or a checked copy), `read`, `open_file`, `read_json`, `stream` (the bytes as
  they come, for a transfer to hash), `verify_file`;
* where things are, for messages and for the store: `url`, `location`, `where`, `beside`,
  `local_root`, `footprint`, `share_beside`, `lock_folder`;
* what the storage can do (zarr's ``supports_*`` flags): `mappable`, `in_place`,
  `prefetches`, `verifies_reads` and `per_block`, `streams`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidCacheError, Problem

if TYPE_CHECKING:
    from .local import FolderLock

#: ``(bytes, xxh3_128 of the whole, xxh3_128 of each block)`` of one file read back whole.
Digests = tuple[int, str, list[str]]
#: ``(descriptor, offset in the data file, bytes)``: a file of this machine holding those bytes
#: of a data file from its own byte 0 (`Files.map_pieces`).
Piece = tuple[int, int, int]


class Files(abc.ABC):
    """The storage of one cache's data files (module docstring). Pickles without descriptors,
    connections or threads: each process opens its own."""

    # -- what the storage can do -------------------------------------------------------------
    #: Data files are files of this machine that can be memory-mapped: `map` returns maps (and
    #: reads may return views of them); else `map` returns None and reads return copies.
    mappable: bool
    #: Data files can be read in place, mapped from files of this machine (`map_pieces`): a
    #: local cache's files, a remote cache's block cache entries (once all of a file's are there).
    in_place: bool
    #: `prefetch` of a plain range starts something (fetches in the background); False where
    #: the kernel's readahead already serves sequential reads (a local disk).
    prefetches: bool
    #: Every read is checked against the manifest's digests before it is handed out (`per_block`
    #: says at which grain); False where reads are not checked (a local cache: `verify` checks it).
    verifies_reads: bool

    @property
    @abc.abstractmethod
    def streams(self) -> int:
        """Files a transfer or a verification reads at once (each one stream)."""

    def per_block(self, name: str) -> bool:
        """Whether reads of ``name`` are checked per block of blocks.json (else per whole file,
        or not at all: `verifies_reads`)."""
        return False

    # -- where things are --------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def url(self) -> str | None:
        """The cache's URL (``s3://bucket/root/<hash>``), None for a cache on this machine."""

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the cache is, for messages: its URL or its folder."""

    @abc.abstractmethod
    def where(self, name: str) -> str:
        """Where data file ``name`` is, for messages: a URL or a path."""

    @abc.abstractmethod
    def beside(self, name: str) -> str:
        """Where a file of the cache's shards root is (``<root>/<name>``, e.g. its statistics
        sidecar ``.stats/<hash>.json``), for messages: a URL or a path."""

    @property
    @abc.abstractmethod
    def local_root(self) -> Path | None:
        """The shards root on this machine's disk that holds the cache (its folder's parent);
        None for a cache that is not on this machine (only its JSON files are)."""

    @abc.abstractmethod
    def footprint(self) -> int:
        """Bytes the cache's files take where they are stored (its data files and JSON files)."""

    @abc.abstractmethod
    def share_beside(self, name: str, data: bytes) -> None:
        """Make ``data``, just written to ``<local folder's parent>/<name>``, visible at
        `beside` (``name``) to the cache's other readers: uploaded into a remote cache's root;
        nothing more for a local cache, whose folder's parent is its root."""

    @abc.abstractmethod
    def lock_folder(self) -> FolderLock | None:
        """Take the shared lock readers hold on the cache's folder while it is open (protocol.md
        6, "Caches in use"); None where there is no folder of its data to lock (remote)."""

    # -- the descriptor interface ------------------------------------------------------------
    @abc.abstractmethod
    def open(self, name: str) -> int:
        """A descriptor of data file ``name`` (what `preadv` and `prefetch` take)."""

    @abc.abstractmethod
    def preadv(self, fd: int, views: Sequence[memoryview], offset: int, /) -> int:
        """Fill ``views`` in order from byte ``offset`` (as ``os.preadv``: fewer bytes only at
        the end of the file)."""

    @abc.abstractmethod
    def prefetch(self, fd: int, start: int, stop: int, *, scattered: bool = False) -> None:
        """Hint that bytes ``[start, stop)`` of ``fd`` are about to be read; ``scattered``: in
        small pieces here and there (the scales of a float8_e4m3 cache), which no readahead
        foresees."""

    @abc.abstractmethod
    def close(self, fd: int) -> None:
        """Release descriptor ``fd``."""

    @abc.abstractmethod
    def close_all(self, wait: bool = True) -> None:
        """Release what this process holds beyond its descriptors (buffers, threads): the cache
        is closed. ``wait=False`` never waits for another thread (`Shards.__del__`)."""

    # -- files read in place -----------------------------------------------------------------
    @abc.abstractmethod
    def map_pieces(self, name: str, nbytes: int) -> list[Piece] | None:
        """The first ``nbytes`` of data file ``name`` as files of this machine to map read-only in
        their place, each from its own byte 0 (`Piece`; offsets are multiples of the page size):
        the file itself, or the block cache's entries of its units (checked as they are opened).
        The descriptors are the caller's to close. None (nothing left open) where that cannot be
        done now: a unit of a remote cache not in the block cache yet; the caller reads the file
        into buffers meanwhile and may ask again."""

    def pieces_of(self, nbytes: int) -> int:
        """How many pieces `map_pieces` gives for the first ``nbytes`` of a data file (one: the
        file itself, where the storage keeps whole files)."""
        return 1

    @abc.abstractmethod
    def size_now(self, fd: int) -> int:
        """Bytes the data file open as ``fd`` holds now: a local file may have been cut short since
        it was opened (``fstat``); a remote one holds what the manifest says (its block cache
        entries are never cut short: docs/remote.md, "What the block cache trusts")."""

    # -- whole files -------------------------------------------------------------------------
    @abc.abstractmethod
    def map(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any] | None:
        """Data file ``name`` as a read-only array of ``dtype`` and ``shape`` backed by a memory
        map; None where the storage cannot map (`mappable` is False: read it instead)."""

    def load(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """Data file ``name`` as a read-only array: mapped where the storage can, else a copy
        read whole (checked, where the storage checks reads)."""
        mapped = self.map(name, dtype, shape)
        if mapped is not None:
            return mapped
        out = np.frombuffer(self.read(name), dtype=dtype).reshape(shape)
        out.flags.writeable = False
        return out

    @abc.abstractmethod
    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        """Bytes ``[start, stop)`` of data file ``name`` (to its end by default), as a new buffer."""

    @abc.abstractmethod
    def open_file(self, name: str) -> Any:
        """Data file ``name`` as a binary file object for reading (``with`` it): the file itself,
        or its bytes read whole (once, then kept until `close_all`)."""

    @abc.abstractmethod
    def read_json(
        self, name: str, max_bytes: int, kind: type[InvalidCacheError], *, every_number: bool = True
    ) -> tuple[Any, list[Problem]]:
        """JSON file ``name`` of the cache read again from where it lives, under the strict rules of
        every JSON file of a cache (`protocol.jsonfile`): ``(value, [])``, or ``(None, [the
        problem, as a kind problem])``."""

    @abc.abstractmethod
    def stream(self, name: str, start: int = 0, stop: int | None = None) -> Iterator[memoryview]:
        """The bytes of ``name`` from ``start`` to ``stop`` (its size by default), in order and
        unchecked (a transfer hashes them), never more than one byte past ``stop``; each piece is
        valid until the next one is asked for."""

    @abc.abstractmethod
    def verify_file(self, name: str, block_size: int | None, tick: Callable[[int], None]) -> Digests:
        """Read ``name`` whole, from its source (never from a cache of it): `Digests` (block
        digests of ``block_size`` bytes, none without). `CacheNotFoundError` when it is missing or
        cannot be read, `NotRegularFileError` when it is not a regular file."""
