"""The block cache: verified pieces of remote caches on local disk, bounded in size, shared
safely by every process of a node.

Layout of the folder (``$SAEV_SHARDS_BLOCK_CACHE``, else ``$XDG_CACHE_HOME/saev-shards``,
else ``~/.cache/saev-shards``)::

    blocks/<xx>/<key>     one entry per block; its key is the block's xxh3_128 digest as the
                          manifest records it (blocks.json), or ``file-<digest>`` for a whole
                          file of a cache verified per whole file
    tmp/                  entries being written; renamed into blocks/ once complete
    roots/<id>/<HASH>/    the JSON files of remote caches opened here (see `files`)
    trim.lock             held by the process that trims the cache

Why it is safe to share: an entry appears by one ``rename`` of a complete file (never
half-written at its name); an entry is named by the digest of its bytes, so two processes
that fetch the same block write the same bytes; every process checks an entry's size and
digest when it opens it (xxh3 hashes at tens of GB/s) and discards one that fails; and
deleting an entry (trimming) never disturbs a process that holds it open (POSIX keeps the
file until it is closed), while one that finds it gone fetches it again.

Bounded: after every ``limit / 32`` bytes a process inserts, it trims the cache back to
90 % of the limit, oldest use first (an entry's modification time is set on each open), under
an exclusive lock that no reader waits for. Between two trims the cache can exceed the
limit by what the processes inserted meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import xxhash

from ..fileio import DIRECT_ALIGN, DISK_FULL_ERRNOS, free_bytes, open_direct, pwrite_direct, take_lock

CACHE_ENV = "SAEV_SHARDS_BLOCK_CACHE"
LIMIT_ENV = "SAEV_SHARDS_BLOCK_CACHE_BYTES"
#: The size limit when none is given: 64 GiB, or half the free space where less is free.
DEFAULT_LIMIT = 64 << 30
#: A trim leaves the cache at this fraction of its limit (room for the next inserts).
TRIM_TO = 0.9
#: Temporary files older than this were left by a killed process; a trim removes them.
STALE_SECONDS = 3600


def default_folder() -> Path:
    """``$SAEV_SHARDS_BLOCK_CACHE``, else ``$XDG_CACHE_HOME/saev-shards``, else ``~/.cache/saev-shards``."""
    given = os.environ.get(CACHE_ENV, "")
    if given:
        return Path(given).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "saev-shards"


def _limit_from_env() -> int | None:
    value = os.environ.get(LIMIT_ENV, "")
    if not value:
        return None
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"${LIMIT_ENV}: expected a number of bytes, found {value!r}") from None
    if limit < 1:
        raise ValueError(f"${LIMIT_ENV}: expected a number of bytes >= 1, found {limit}")
    return limit


def digest_of(fd: int, nbytes: int) -> str:
    """xxh3_128 of the first ``nbytes`` of the open file ``fd`` (a map: one call, GIL released)."""
    if nbytes == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as view:
        with contextlib.suppress(AttributeError, OSError):  # read ahead: entries are written past the page cache
            view.madvise(mmap.MADV_WILLNEED)
        return xxhash.xxh3_128_hexdigest(view)


class BlockCache:
    """A folder of verified entries (module docstring). Pickles as its folder and limit."""

    def __init__(self, folder: str | os.PathLike[str] | None = None, limit: int | None = None) -> None:
        self.folder = Path(folder).absolute() if folder is not None else default_folder()
        self._given_limit = limit if limit is not None else _limit_from_env()
        self._reset()

    def _reset(self) -> None:
        self._limit: int | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._full_warned = False

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "_given_limit": self._given_limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def limit(self) -> int:
        """Bytes the cache may hold (given, ``$SAEV_SHARDS_BLOCK_CACHE_BYTES``, or `DEFAULT_LIMIT`
        capped at half the free space when first used)."""
        if self._limit is None:
            if self._given_limit is not None:
                self._limit = self._given_limit
            else:
                free = free_bytes(self.folder)
                self._limit = DEFAULT_LIMIT if free is None else max(1 << 30, min(DEFAULT_LIMIT, free // 2))
        return self._limit

    def path(self, key: str) -> Path:
        return self.folder / "blocks" / key[-2:] / key

    def roots(self) -> Path:
        """Where the JSON files of remote caches opened here are kept (`files.manifest_folder`)."""
        return self.folder / "roots"

    def tmp_path(self, key: str) -> Path:
        """A temporary name for an entry being written (unique to this process and thread)."""
        tmp = self.folder / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"

    # -- entries -----------------------------------------------------------------------------
    def open(self, key: str, nbytes: int, digest: str) -> int | None:
        """A descriptor of entry ``key`` if it holds exactly ``nbytes`` bytes whose xxh3_128 is
        ``digest``; None when it is missing or fails (a failing entry is removed)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != nbytes or digest_of(fd, nbytes) != digest:
                self._discard(path, st)
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: trims remove the oldest first
        return fd

    def insert(self, key: str, data: Any) -> int | None:
        """Store ``data`` (verified bytes) as entry ``key``; a descriptor of it, or None when the
        disk is full even after a trim (the caller serves ``data`` from memory)."""
        view = memoryview(data).cast("B")
        for attempt in range(2):
            tmp = self.tmp_path(key)
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _write_entry(tmp, fd, view)
                except BaseException:
                    os.close(fd)
                    raise
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if err.errno not in DISK_FULL_ERRNOS:
                    raise
                if attempt == 0:
                    self.trim(target=0.5)
                    continue
                self._warn_full(err)
                return None
            return self._commit(tmp, key, fd, view.nbytes)
        return None

    def commit_file(self, tmp: Path, key: str) -> int:
        """Publish the complete, verified temporary file ``tmp`` (from `tmp_path`) as entry ``key``."""
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        return self._commit(tmp, key, fd, os.fstat(fd).st_size)

    def _commit(self, tmp: Path, key: str, fd: int, nbytes: int) -> int:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)  # another process may have put the same bytes there: either is right
        with self._lock:
            self._pending += nbytes
            due = self._pending >= max(1, self.limit // 32)
            if due:
                self._pending = 0
        if due:
            self.trim()
        return fd

    def _discard(self, path: Path, bad: os.stat_result) -> None:
        """Remove a failing entry, unless another process has replaced it meanwhile."""
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (bad.st_dev, bad.st_ino):
                os.unlink(path)

    def warn_unwritable(self, err: OSError) -> None:
        """Say once that entries cannot be written here (reads go on from the server and memory)."""
        self._warn_once(
            f"cannot write to the block cache ({err}); blocks are read without being kept: "
            f"set {CACHE_ENV} to a writable folder"
        )

    def _warn_full(self, err: OSError) -> None:
        self._warn_once(
            f"the block cache's disk is full ({os.strerror(err.errno or errno.ENOSPC)}); blocks are read without "
            f"being kept: free some space or set {CACHE_ENV} to another folder"
        )

    def _warn_once(self, what: str) -> None:
        if not self._full_warned:
            self._full_warned = True
            warnings.warn(f"{self.folder}: {what}", stacklevel=4)

    # -- size --------------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """``(last use, size, path)`` of every entry."""
        out = []
        for sub in _scan(self.folder / "blocks"):
            for e in _scan(Path(sub.path)):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
        return out

    def usage(self) -> int:
        """Bytes the entries hold now."""
        return sum(size for _, size, _ in self.entries())

    def trim(self, target: float = TRIM_TO) -> int:
        """Remove the least recently used entries until the cache holds at most ``target`` of its
        limit (when it holds more than the limit, or ``target`` < `TRIM_TO`), and temporary files
        left by killed processes. Returns the bytes removed; 0 when another process is trimming."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = take_lock(self.folder / "trim.lock")
        if lock is None:
            return 0
        try:
            now = time.time()
            for e in _scan(self.folder / "tmp"):
                with contextlib.suppress(OSError):
                    if now - e.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                        os.unlink(e.path)
            entries = sorted(self.entries())
            total = sum(size for _, size, _ in entries)
            if total <= self.limit and target >= TRIM_TO:
                return 0
            goal = int(self.limit * target)
            removed = 0
            for _, size, path in entries:
                if total - removed <= goal:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed += size
            return removed
        finally:
            os.close(lock)


def _write_entry(tmp: Path, fd: int, view: memoryview) -> None:
    """Write a new entry's bytes into ``tmp`` (open as ``fd``) and make it read-only: whole
    4 KiB blocks with O_DIRECT where the filesystem allows it and ``view`` is page-aligned (the
    pooled buffers of `files` are), so that storing a block costs no copy into the page cache
    and never pushes out what the node's readers have cached; the rest buffered."""
    direct = open_direct(tmp) if view.nbytes >= DIRECT_ALIGN else None
    try:
        pwrite_direct(direct, fd, view, 0)
    finally:
        if direct is not None:
            os.close(direct)
    os.fchmod(fd, 0o444)


def _scan(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def root_id(url: str) -> str:
    """A short, stable folder name for a remote root (its URL hashed)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]
