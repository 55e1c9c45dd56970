"""The block cache: verified pieces of remote caches on local disk, bounded in size, shared
safely by every process of a node, private to its owner.

Layout of the folder (``$SAEV_SHARDS_BLOCK_CACHE``, else ``$XDG_CACHE_HOME/saev-shards``,
else ``~/.cache/saev-shards``)::

    blocks/<xx>/<key>     one entry per block; its key is the block's xxh3_128 digest as the
                          manifest records it (blocks.json), or ``file-<digest>`` for a whole
                          file of a cache verified per whole file
    blocks/<xx>/<key>.<uid>.<inode>.<ctime>.seal
                          an empty file: user ``uid`` verified entry ``key`` while it was that
                          inode with that change time (`seals.seal_name`)
    tmp/                  entries being written; renamed into blocks/ once complete
    roots/<id>/<HASH>/    the JSON files of remote caches opened here (see `remote_json`)
    trim.lock             held by the process that trims the cache

Why it is safe to share: an entry appears by one ``rename`` of a complete file (never
half-written at its name); an entry is named by the digest of its bytes, so two processes
that fetch the same block write the same bytes; an entry is served only once its size and
digest were checked, and deleting an entry (trimming) never disturbs a process that holds it
open or mapped (POSIX keeps the file until then), while one that finds it gone fetches it
again.

Checked once, not by every process: an entry hashed and found right (or written from
verified bytes) gets this user's *seal* beside it, and is trusted without reading a byte
while it is as it was sealed (`seals`; docs/remote.md, "What the block cache trusts").

Never outside its folder: the folder itself may be reached through a link (the user's
choice of where it lives), but nothing inside it is: every folder and entry is opened
relative to its parent's descriptor with ``O_NOFOLLOW``, so a link (or a file) at the name
of ``blocks/``, ``tmp/``, ``roots/`` or one of their folders is removed, the link itself and
never what it leads to, and a real folder made in its place; an entry that is not a regular
file (a link, a FIFO, a folder) is opened without blocking, found out by ``fstat``,
discarded and fetched again. A trim removes names inside the folders it opened so.

Private (docs/remote.md, "Who can read the block cache"): it holds data from private
buckets, so its folders are made 0700 and its files 0600 (entries 0400), an existing folder
of its owner's with looser modes is made 0700, and a folder that belongs to another user is
refused (`BlockCacheError`), unless it is shared with a group on purpose: a folder with the
set-group-ID bit and read, write and search permission for its group and none for others
(``install -d -m 2770 -g GROUP DIR``), of a group the user is in. In such a folder folders
are made 2770 and files 0660 (entries 0440).

Bounded: after every ``limit / 32`` bytes a process inserts, it trims the cache back to
90 % of the limit, oldest use first (on each open the modification time of the entry's seal
is set, or the entry's own where it has none; a trim removes an entry with its seals, and
seals of entries replaced or gone), under
an exclusive lock that no reader waits for. Between two trims the cache can exceed the
limit by what the processes inserted meanwhile. A limit of 0 is no disk cache at all:
nothing is written under the folder, and the JSON files of the caches opened go to
`memory_folder`. A full disk (or a folder that cannot be written) leaves the reads going
from memory, with one warning per process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from ..errors import BlockCacheError
from ..fileio import DISK_FULL_ERRNOS, free_bytes
from .folders import (
    PRIVATE_MODES,
    check_folder,
    lock_file,
    memory_folder,
    names,
    remove_name,
    subdir,
    write_new_file,
)
from .seals import is_sealed, scan_blocks, seal_if_checked, write_seal

CACHE_ENV = "SAEV_SHARDS_BLOCK_CACHE"
LIMIT_ENV = "SAEV_SHARDS_BLOCK_CACHE_BYTES"
#: The size limit when none is given: 64 GiB, or half the free space where less is free.
DEFAULT_LIMIT = 64 << 30
#: A trim leaves the cache at this fraction of its limit (room for the next inserts).
TRIM_TO = 0.9
#: Temporary files older than this were left by a killed process; a trim removes them.
STALE_SECONDS = 3600
#: After a full disk, no entry is written for this long (each try would trim and fail again).
FULL_PAUSE = 10.0
_SIZE_RE = re.compile(r"(\d{1,20})\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def default_folder() -> Path:
    """``$SAEV_SHARDS_BLOCK_CACHE``, else ``$XDG_CACHE_HOME/saev-shards``, else ``~/.cache/saev-shards``."""
    given = os.environ.get(CACHE_ENV, "")
    if given:
        return Path(given).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "saev-shards"


def parse_limit(text: str, what: str = f"${LIMIT_ENV}") -> int:
    """Bytes from ``"64G"``, ``"512MiB"`` or plain bytes (binary units); 0 is no disk cache.
    `BlockCacheError` naming ``what`` for anything else."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise BlockCacheError(
            f"{what}: expected a size in bytes (like 64G, 512M or 1073741824; 0 for no disk cache), found {text!r:.60}"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def _limit_from_env() -> int | None:
    value = os.environ.get(LIMIT_ENV, "")
    return parse_limit(value) if value.strip() else None


def digest_of(fd: int, nbytes: int) -> str:
    """xxh3_128 of the first ``nbytes`` of the open file ``fd`` (a map: one call, GIL released)."""
    if nbytes == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as view:
        with contextlib.suppress(AttributeError, OSError):  # read ahead: entries are written past the page cache
            view.madvise(mmap.MADV_WILLNEED)
        return xxhash.xxh3_128_hexdigest(view)


class TempEntry:
    """A temporary entry being written (`BlockCache.writing`): its key, the descriptor of
    ``tmp/``, its name there, its own descriptor, and whether it was committed."""

    __slots__ = ("committed", "dir_fd", "fd", "key", "name")

    def __init__(self, key: str, dir_fd: int, name: str, fd: int) -> None:
        self.key = key
        self.dir_fd = dir_fd
        self.name = name
        self.fd = fd
        self.committed = False


class _Unwritable(Exception):
    """A local write for the block cache failed (`error`: the `OSError`): a full disk, a folder
    that cannot be written. Callers fall back to memory (`memory_folder`)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


#: Folders (with the kind of problem) this process has warned about: one warning each.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class BlockCache:
    """A folder of verified entries (module docstring). Pickles as its folder and limit."""

    def __init__(self, folder: str | os.PathLike[str] | None = None, limit: int | None = None) -> None:
        self.folder = Path(folder).absolute() if folder is not None else default_folder()
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise BlockCacheError(f"block cache limit: expected a number of bytes >= 0, found {limit!r:.40}")
        self._given_limit = limit if limit is not None else _limit_from_env()
        self._reset()

    def _reset(self) -> None:
        self._limit: int | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._modes: tuple[int, int, int] | None = None
        self._paused_until = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "_given_limit": self._given_limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def disabled(self) -> bool:
        """A limit of 0: no disk cache (nothing is written under the folder)."""
        return self._given_limit == 0

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

    @property
    def modes(self) -> tuple[int, int, int]:
        """``(folders, files, entries)`` modes: `folders.PRIVATE_MODES`, or `folders.SHARED_MODES` in a folder
        shared with a group on purpose (checked, and the folder made, on first use)."""
        if self._modes is None:
            self._modes = check_folder(self.folder, CACHE_ENV)
        return self._modes

    def path(self, key: str) -> Path:
        return self.folder / "blocks" / key[-2:] / key

    # -- folders -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _dir(self, *names: str, create: bool = True) -> Iterator[int | None]:
        """A descriptor of ``<folder>/<names...>``, each step opened without following a link
        (made, or remade in place of a link or a file, with ``create``); None when a step is
        missing and not ``create``. The cache's folder itself, removed while in use (``rm -rf``
        of it), is made again (and checked: `check_folder`) with ``create``."""
        dir_mode = self.modes[0]
        try:
            fd: int | None = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # may be a link
        except FileNotFoundError:
            if not create:
                raise
            self._modes = None
            dir_mode = self.modes[0]
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in names:
                assert fd is not None
                sub = subdir(fd, name, dir_mode if create else None)
                os.close(fd)
                fd = sub
                if fd is None:
                    break
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def json_folder(self, root: str, name: str, memory: bool = False) -> Path:
        """``roots/<id of root>/<name>`` made, its ``.stats`` beside it, no link followed on the
        way (in `memory_folder` with ``memory``, or when the cache is `disabled`): where
        `remote_json.local_folder` keeps the JSON files of a remote cache. `_Unwritable` when the
        folders cannot be made here."""
        top = memory_folder() if memory or self.disabled else self.folder
        try:
            dir_mode = PRIVATE_MODES[0] if top != self.folder else self.modes[0]
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for step in ("roots", root_id(root)):
                    sub = subdir(fd, step, dir_mode)
                    os.close(fd)
                    assert sub is not None
                    fd = sub
                for last in (".stats", name):
                    made = subdir(fd, last, dir_mode)
                    assert made is not None
                    os.close(made)
            finally:
                os.close(fd)
        except OSError as err:
            raise _Unwritable(err) from None
        return top / "roots" / root_id(root) / name

    @property
    def file_mode(self) -> int:
        """The mode of the JSON files kept under ``roots/`` (0600, or 0660 when shared)."""
        return self.modes[1]

    # -- entries -----------------------------------------------------------------------------
    def open(self, key: str, nbytes: int, digest: str) -> int | None:
        """A descriptor of entry ``key`` if it is a regular file of exactly ``nbytes`` bytes whose
        xxh3_128 is ``digest``: taken without reading a byte when this user sealed it as it is
        now (`seals.seal_name`), else hashed now (and sealed when it matches); None when it is missing
        or fails (a failing entry, or anything else at its name, is removed: never through a
        link, and never blocking on a FIFO)."""
        if self.disabled:
            return None
        try:
            with self._dir("blocks", key[-2:], create=False) as dfd:
                if dfd is None:
                    return None
                try:
                    fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                except FileNotFoundError:
                    return None
                except OSError as err:
                    if err.errno == errno.ELOOP:  # a link: removed (the link, not what it leads to)
                        remove_name(dfd, key, None)
                    return None  # unreadable here (another member's entry): fetched again
                try:
                    before = time.time()  # an entry of another member is sealed only if older (seals.SEAL_AFTER)
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
                        good = False
                    elif is_sealed(dfd, key, st, self.modes[2]):
                        return fd
                    else:
                        good = digest_of(fd, nbytes) == digest
                    if not good:
                        os.close(fd)
                        remove_name(dfd, key, st)
                        return None
                    if not seal_if_checked(fd, dfd, key, st, before, self.modes[2]):
                        with contextlib.suppress(OSError):
                            os.utime(fd)  # used now: trims remove the oldest first
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    raise
                return fd
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise
            return None  # the folder cannot be read: the block is fetched (and kept if it can be)

    def insert(self, key: str, data: Any) -> int | None:
        """Store ``data`` (verified bytes) as entry ``key``; a descriptor of it, or None when the
        cache is `disabled` or the disk is full even after a trim (the caller serves ``data``
        from memory; one warning per process)."""
        if self.disabled or self.paused:
            return None
        view = memoryview(data).cast("B")
        trimmed = removed = False
        while True:
            try:
                with self.writing(key) as tmp:
                    write_new_file(tmp.fd, view)
                    return self.commit(tmp)
            except OSError as err:
                if err.errno == errno.ENOENT and not removed:
                    removed = True  # the folder was removed while the entry was written: made anew
                    continue
                if err.errno not in DISK_FULL_ERRNOS:
                    raise
                if not trimmed:
                    trimmed = True
                    with contextlib.suppress(OSError):
                        self.trim(target=0.5)
                    continue
                self.pause_writes(err)
                return None

    @property
    def paused(self) -> bool:
        """Whether entries are not written for now (`pause_writes`)."""
        return time.monotonic() < self._paused_until

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[TempEntry]:
        """A new temporary entry for ``key`` in ``tmp/``, open for reading and writing: `commit`
        it inside the block; otherwise (an error, a mismatch) it is closed and removed."""
        with self._dir("tmp") as tmp_fd:
            assert tmp_fd is not None
            name = f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=tmp_fd)  # left by a killed thread of a process with our pid
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            tmp = TempEntry(key, tmp_fd, name, os.open(name, flags, PRIVATE_MODES[1], dir_fd=tmp_fd))
            try:
                yield tmp
            finally:
                if not tmp.committed:
                    os.close(tmp.fd)
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=tmp_fd)

    def commit(self, tmp: TempEntry) -> int:
        """Publish the complete, verified temporary entry ``tmp`` (from `writing`): made read-only,
        renamed into ``blocks/`` and sealed (`seals.seal_name`). Returns its descriptor (the caller's to
        close)."""
        os.fchmod(tmp.fd, self.modes[2])
        nbytes = os.fstat(tmp.fd).st_size
        with self._dir("blocks", tmp.key[-2:]) as dfd:
            assert dfd is not None
            try:
                os.replace(tmp.name, tmp.key, src_dir_fd=tmp.dir_fd, dst_dir_fd=dfd)
            except OSError as err:
                if err.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                remove_name(dfd, tmp.key, None)  # a folder at the entry's name
                os.replace(tmp.name, tmp.key, src_dir_fd=tmp.dir_fd, dst_dir_fd=dfd)
            # Its bytes are those verified: sealed as it is now, so no process hashes it again.
            # (Where the seal cannot be written, `writing` closes the entry's descriptor: unsealed,
            # the entry is checked by the next `open`.)
            write_seal(dfd, tmp.key, os.fstat(tmp.fd), self.modes[2])
            tmp.committed = True
        with self._lock:  # another process may have put the same bytes there: either is right
            self._pending += nbytes
            due = self._pending >= max(1, self.limit // 32)
            if due:
                self._pending = 0
        if due:
            with contextlib.suppress(OSError):  # trimming is housekeeping: never fails a read
                self.trim()
        return tmp.fd

    def pause_writes(self, err: OSError) -> None:
        """Write no entry for `FULL_PAUSE` seconds after a write failed (each try would fail
        again: a full disk, a folder that cannot be written); say so once."""
        self._paused_until = time.monotonic() + FULL_PAUSE
        self.warn_unwritable(err)

    def warn_unwritable(self, err: OSError) -> None:
        """Say once that entries cannot be written here (reads go on from the server and memory)."""
        if err.errno in DISK_FULL_ERRNOS:
            self.warn_full(err)
            return
        self._warn_once(
            f"cannot write to the block cache ({err.strerror or err}); blocks are read without being kept "
            f"(from memory): set {CACHE_ENV} to a writable folder"
        )

    def warn_full(self, err: OSError) -> None:
        self._warn_once(
            f"the block cache's disk is full ({os.strerror(err.errno or errno.ENOSPC)}); blocks are read without "
            f"being kept (from memory): free some space or set {CACHE_ENV} to another folder"
        )

    def _warn_once(self, what: str) -> None:
        with _WARNED_LOCK:
            if str(self.folder) in _WARNED:
                return
            _WARNED.add(str(self.folder))
        warnings.warn(f"{self.folder}: {what}", stacklevel=4)

    # -- size --------------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """``(last use, size, path)`` of every entry (seals left out)."""
        with self._dir("blocks", create=False) as blocks, scan_blocks(blocks) as (found, _):
            return [(e.last_use, e.size, self.folder / "blocks" / e.sub / e.name) for e in found]

    def usage(self) -> int:
        """Bytes the entries hold now."""
        return sum(size for _, size, _ in self.entries())

    def trim(self, target: float = TRIM_TO) -> int:
        """Remove the least recently used entries (with their seals) until the cache holds at most
        ``target`` of its limit (when it holds more than the limit, or ``target`` < `TRIM_TO`),
        temporary files left by killed processes, and seals of entries replaced or gone. Returns
        the bytes removed; 0 when another process is trimming. Only names inside the cache's own
        folders are removed (module docstring)."""
        if self.disabled:
            return 0
        with self._dir() as top:
            assert top is not None
            lock = lock_file(top, "trim.lock", self.modes[1])
        if lock is None:
            return 0
        try:
            now = time.time()
            with self._dir("tmp", create=False) as tmp:
                for name in names(tmp) if tmp is not None else []:
                    assert tmp is not None
                    with contextlib.suppress(OSError):
                        st = os.stat(name, dir_fd=tmp, follow_symlinks=False)
                        if now - st.st_mtime > STALE_SECONDS:
                            remove_name(tmp, name, st)
            with self._dir("blocks", create=False) as blocks, scan_blocks(blocks) as (found, stale):
                for dfd, name in stale:
                    remove_name(dfd, name, None)
                found.sort(key=lambda e: e.last_use)
                total = sum(e.size for e in found)
                if total <= self.limit and target >= TRIM_TO:
                    return 0
                goal = int(self.limit * target)
                removed = 0
                for entry in found:
                    if total - removed <= goal:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=entry.dfd)
                        removed += entry.size
                    for seal in entry.seals:
                        remove_name(entry.dfd, seal, None)
                return removed
        finally:
            os.close(lock)


def root_id(url: str) -> str:
    """A short, stable folder name for a remote root (its URL hashed)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]
