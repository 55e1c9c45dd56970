"""What a shards root holds: published caches (listed, summarised, removed) and
unpublished folders (staging and partial copies: live, or stale and removable)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import time
import warnings
from pathlib import Path

from .. import reader
from ..errors import (
    CacheInUseError,
    CacheRefError,
    ProtocolWarning,
    ShardsError,
    UnknownCacheError,
)
from ..fileio import (
    NO_FLOCK_ERRNOS,
    make_writable,
    take_lock,
    try_flock,
)
from ..humanize import human_bytes
from ..protocol import is_cache_name
from ..protocol.common import MANIFEST_FILE, MAX_METADATA_BYTES, METADATA_FILE
from ..protocol.jsonfile import read_json_file
from ..protocol.metadata import Metadata, parse_metadata
from ..protocol.staging import LOCK_SUFFIX, OLD_LOCK_FILE, STAGING_PREFIX, part_record_shard
from ..storage.url import is_url
from .inuse import users
from .roots import (
    COPY_PREFIX,
    SHUFFLE_LOCK_FILE,
    SHUFFLE_PREFIX,
    SHUFFLE_RANKS_PREFIX,
    PathLike,
    Roots,
    _cache_names,
    _scan,
    check_reference,
)

# --------------------------------------------------------------------------------------
# listing and removing


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cache directory in a root, as `list_caches` found it (no checksums read)."""

    path: Path
    #: Parsed metadata.json when it is readable, else None.
    metadata: Metadata | None
    #: Shard files listed in the manifest, when the cache opened.
    n_shards: int | None
    #: Sum of the sizes of the regular files in the directory.
    nbytes: int
    #: `open`'s error message when the cache does not open, else None.
    problem: str | None

    @property
    def hash(self) -> str:
        return self.path.name

    @property
    def ok(self) -> bool:
        return self.problem is None


def list_caches(root: PathLike) -> list[CacheEntry]:
    """Every published cache in ``root``, sorted by hash, each opened (sizes checked, no checksums).

    Staging (``.staging-*``), partial copies (``.copying-*``) and folders not named by a
    hash are not caches and are skipped; `list_unpublished` lists the first two.
    """
    out = []
    base = Path(root).absolute()
    for name in _cache_names(base):
        path = base / name
        try:
            nbytes, _ = _size_and_mtime(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        try:
            shards = open_quietly(path)  # listings show the protocol column
        except (ShardsError, OSError) as err:  # OSError: e.g. an unreadable cache among readable ones
            out.append(CacheEntry(path, _read_metadata(path), None, nbytes, str(err)))
            continue
        out.append(CacheEntry(path, shards.metadata, shards.n_shards, nbytes, None))
    return out


def list_unpublished(root: PathLike) -> list[Path]:
    """Staging directories and partial copies in ``root``: being written, or interrupted.

    Their lock files (``.staging-<hash>.lock``, beside them) are not listed."""
    base = Path(root).absolute()
    return sorted(
        base / e.name
        for e in _scan(base)
        if e.name.startswith((STAGING_PREFIX, COPY_PREFIX)) and e.is_dir(follow_symlinks=False)
    )


#: What each kind of `Unpublished` folder is, in words.
KIND_NAMES = {
    "staging": "staging",
    "copy": "partial copy",
    "shuffle": "shuffle scratch",
    "ranks": "shuffle ranks' meeting folder",
    "lock": "lock file",
}


@dataclasses.dataclass(frozen=True)
class Unpublished:
    """A folder (or lock file) in a root that is not a cache: a writer's staging folder
    (``.staging-<hash>``), a partial copy (``.copying-<hash>``), the scratch folder of a
    shuffle (``.shuffle-<hash>``, its buckets and runs), the folder where a shuffle's ranks meet
    (``.shuffle-ranks-<hash>``, their records), or a staging lock file whose folder is gone
    (``.staging-<hash>.lock``)."""

    path: Path
    #: "staging", "copy", "shuffle", "ranks" or "lock" (`KIND_NAMES` says each in words).
    kind: str
    #: Bytes of the regular files in it (the file itself for a lock).
    nbytes: int
    #: Seconds since anything in it last changed.
    age: float
    #: A live process holds its lock: a writer at work, or a copy in progress.
    live: bool
    #: Shards sealed in a staging folder (its part records; all of them once finalizing wrote
    #: shards.json), and how many the cache has (None when its metadata.json is unreadable).
    sealed: int = 0
    n_shards: int | None = None

    @property
    def resumable(self) -> bool:
        """Interrupted with work a rerun keeps: sealed shards of a writer, the complete files of
        a copy, the buckets and runs of a shuffle. Removing it makes that rerun start over."""
        if self.kind == "staging":
            return self.sealed > 0
        return self.kind in ("copy", "shuffle") and self.nbytes > 0

    @property
    def state(self) -> str:
        """In words: live, interrupted and resumable (what is kept, how to resume), or abandoned."""
        if self.live:
            return {
                "staging": "a writer holds it",
                "copy": "a copy holds it",
                "shuffle": "a shuffle holds it",
                "ranks": "a shuffle's ranks are meeting in it",
            }.get(self.kind, "a live process holds it")
        if not self.resumable:
            return "stale, nothing to resume: `saev-shards clean` removes it"
        kept = {
            "staging": f"{self.sealed} of {self.n_shards if self.n_shards is not None else '?'} shards sealed",
            "copy": f"{human_bytes(self.nbytes)} copied",
            "shuffle": f"{human_bytes(self.nbytes)} of buckets and runs",
        }[self.kind]
        again = {"staging": "its writer", "copy": "`saev-shards stage`", "shuffle": "the same shuffle"}[self.kind]
        return f"interrupted, resumable ({kept}): run {again} again to resume; `saev-shards clean` would discard it"

    @property
    def hash(self) -> str:
        name = self.path.name.removeprefix(STAGING_PREFIX).removeprefix(COPY_PREFIX)
        return name.removesuffix(LOCK_SUFFIX)

    @property
    def short_name(self) -> str:
        """``.staging-3f2a9c8d1e2b``: the prefix and 12 digits of the hash."""
        prefix = COPY_PREFIX if self.kind == "copy" else STAGING_PREFIX
        return prefix + self.hash[:12] + (LOCK_SUFFIX if self.kind == "lock" else "")


def unpublished(root: PathLike) -> list[Unpublished]:
    """Every staging folder, partial copy, shuffle scratch folder and orphaned staging lock file in ``root``, with its
    size, its age and whether a live process holds its lock (`is_live`)."""
    base = Path(root).absolute()
    out = []
    now = time.time()
    for e in sorted(_scan(base), key=lambda e: e.name):
        path = base / e.name
        if e.name.startswith(STAGING_PREFIX) and e.name.endswith(LOCK_SUFFIX):
            if os.path.lexists(path.with_name(e.name.removesuffix(LOCK_SUFFIX))):
                continue  # its staging folder is listed instead
            kind = "lock"
        elif e.name.startswith(STAGING_PREFIX) and e.is_dir(follow_symlinks=False):
            kind = "staging"
        elif e.name.startswith(COPY_PREFIX) and e.is_dir(follow_symlinks=False):
            kind = "copy"
        elif e.name.startswith(SHUFFLE_RANKS_PREFIX) and e.is_dir(follow_symlinks=False):
            kind = "ranks"
        elif e.name.startswith(SHUFFLE_PREFIX) and e.is_dir(follow_symlinks=False):
            kind = "shuffle"
        else:
            continue
        try:
            nbytes, mtime = _size_and_mtime(path)
        except FileNotFoundError:  # published or removed meanwhile
            continue
        except PermissionError:  # another user's (a shared $TMPDIR): listed, never judged stale
            out.append(Unpublished(path, kind, 0, max(0.0, now - os.lstat(path).st_mtime), True))
            continue
        sealed, n_shards = _sealed(path) if kind == "staging" else (0, None)
        out.append(Unpublished(path, kind, nbytes, max(0.0, now - mtime), is_live(path, kind), sealed, n_shards))
    return out


def _sealed(staging: Path) -> tuple[int, int | None]:
    """Shards sealed in a staging folder and the cache's shard count (from its metadata.json)."""
    md = _read_metadata(staging)
    n_shards = md.n_shards if md is not None else None
    try:
        names = os.listdir(staging)
    except OSError:
        return 0, n_shards
    if MANIFEST_FILE in names:  # finalizing passed its commit point: every shard is in
        return n_shards or 1, n_shards
    return sum(part_record_shard(name) is not None for name in names), n_shards


def folder_nbytes(path: Path) -> int:
    """Bytes of the regular files in a cache or unpublished folder (what removing it frees)."""
    return _size_and_mtime(path)[0]


def _size_and_mtime(path: Path) -> tuple[int, float]:
    """Bytes of ``path``'s files (one level) and the latest change among them and it.
    `FileNotFoundError` if ``path`` itself is gone; a file inside renamed or removed while it is
    scanned (a live writer sealing a shard) is left out, not taken for the folder's own end."""
    st = os.lstat(path)
    if not os.path.isdir(path):
        return st.st_size, st.st_mtime
    nbytes, mtime = 0, st.st_mtime
    for e in _scan(path):
        try:
            est = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        mtime = max(mtime, est.st_mtime)
        if stat.S_ISREG(est.st_mode):
            nbytes += est.st_size
    return nbytes, mtime


def _lock_of(path: Path, kind: str) -> tuple[Path, bool]:
    """What a live holder of ``path`` locks: the lock file beside a staging folder, the lock
    file inside a shuffle's scratch folder, or the folder of a copy itself (``directory``)."""
    if kind == "staging":
        return path.with_name(path.name + LOCK_SUFFIX), False
    if kind in ("shuffle", "ranks"):
        return path / SHUFFLE_LOCK_FILE, False
    return path, kind == "copy"


def is_live(path: Path, kind: str) -> bool:
    """True when a process holds the lock of this staging folder or copy.

    The probe takes the lock exclusively for an instant, without waiting (writers hold it,
    shared or exclusive, for as long as they run); a writer starting in that instant is told
    the cache is busy, and may simply start again.
    """
    lock, directory = _lock_of(path, kind)
    return _held(lock, directory=directory) or (kind == "staging" and _held(path / OLD_LOCK_FILE, directory=False))


def _held(lock: Path, *, directory: bool) -> bool:
    """Whether another open file holds an ``flock`` on ``lock`` (False when it does not exist)."""
    try:
        fd = os.open(lock, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError:
        return True  # cannot tell (another user's): never treated as stale
    try:
        return not try_flock(fd)
    finally:
        os.close(fd)


def remove_unpublished(item: Unpublished) -> bool:
    """Delete a stale staging folder (and its lock file), partial copy, shuffle scratch folder or orphaned lock file,
    holding its lock while deleting, so no writer can start on it meanwhile. Returns False,
    deleting nothing, when a live process holds the lock."""
    lock, directory = _lock_of(item.path, item.kind)
    if not os.path.lexists(item.path):
        return True  # removed (or published) meanwhile
    # Taken even when the lock file is missing (take_lock creates it): a writer starting
    # now then finds the cache busy instead of resuming into a folder being deleted.
    fd = take_lock(lock, directory=directory)
    if fd is None:
        return False
    try:
        if item.kind == "staging" and _held(item.path / OLD_LOCK_FILE, directory=False):  # an older writer's
            return False
        if item.kind in ("staging", "copy", "shuffle", "ranks") and item.path.is_dir():
            make_writable(item.path)  # a writer killed while publishing leaves it read-only
            shutil.rmtree(item.path)
        if item.kind in ("staging", "lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    finally:
        os.close(fd)
    return True


def _read_metadata(path: Path) -> Metadata | None:
    try:
        return parse_metadata(read_json_file(path / METADATA_FILE, MAX_METADATA_BYTES))
    except (OSError, ValueError):  # ShardsError is a ValueError
        return None


def remove(path: PathLike, *, force: bool = False) -> None:
    """Delete a cache directory (or an unpublished ``.staging-``/``.copying-`` one), read-only or not.

    Refuses anything not named like a cache, so a mistyped path cannot delete other data.
    A symlink to a cache is unlinked; the cache it points to stays.

    A cache in use is refused with `CacheInUseError` naming the processes (`check_not_in_use`):
    readers hold a shared lock on it while it is open, and the removal holds it exclusively
    while it deletes. ``force`` removes it anyway (its readers then fail at their next read).
    An unpublished folder whose writer or copy holds its lock is refused whatever ``force``
    says: deleting it under a live writer would corrupt what it publishes.
    """
    p = Path(path).expanduser().absolute()
    name = p.name
    if not (is_cache_name(name) or name.startswith((STAGING_PREFIX, COPY_PREFIX))):
        raise CacheRefError(
            f"refusing to remove {p}: expected a cache directory named by its hash (64 or 8 hex digits) "
            f"(or a {STAGING_PREFIX}/{COPY_PREFIX} directory), found the name {name!r}"
        )
    if p.is_symlink():
        p.unlink()
        return
    if not p.is_dir():
        raise UnknownCacheError(f"no cache at {p}: no such directory")
    if name.startswith((STAGING_PREFIX, COPY_PREFIX)):
        kind = "staging" if name.startswith(STAGING_PREFIX) else "copy"
        item = Unpublished(p, kind, 0, 0.0, True)
        if not remove_unpublished(item):
            lock, _ = _lock_of(p, kind)
            raise CacheInUseError(
                f"refusing to remove {p}: a live {KIND_NAMES[kind]} holds its lock ({lock}); nothing removed",
                users(lock),
            )
        return
    if not force:
        check_not_in_use(p)
    fd, busy = hold_exclusively(p)
    try:
        if busy and not force:  # a reader opened it since, or one /proc does not show
            check_not_in_use(p, locked=True)
        delete_folder(p)
    finally:
        if fd is not None:
            os.close(fd)


def check_not_in_use(path: Path, *, locked: bool = False) -> None:
    """Raise `CacheInUseError` when processes use the cache folder ``path``: listed from
    ``/proc`` (`inuse.users`), or ``locked`` (its lock is held, by processes ``/proc`` may hide)."""
    found = users(path)
    if not found and not locked:
        return
    who = "; ".join(str(h) for h in found[:10]) + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
    if not found:
        who = "another process holds its lock (the system does not say which)"
    raise CacheInUseError(
        f"refusing to remove {path}: in use by {plural_processes(len(found))}: {who}; nothing removed. Stop them "
        "first, or remove it anyway with --force (force=True): they then fail at their next read",
        found,
    )


def plural_processes(n: int) -> str:
    return "another process" if n == 0 else ("1 process" if n == 1 else f"{n} processes")


def hold_exclusively(path: Path) -> tuple[int | None, bool]:
    """``(fd, busy)``: the folder's fd holding its lock exclusively (None when not taken), and
    whether another process holds the lock (False too where the filesystem does not lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None, False
    try:
        if try_flock(fd):
            return fd, False
        busy = True
    except OSError as err:
        if err.errno not in NO_FLOCK_ERRNOS:
            os.close(fd)
            raise
        busy = False
    os.close(fd)
    return None, busy


def delete_folder(path: Path) -> None:
    """Delete a cache or unpublished folder, read-only or not, without any check: for callers
    that hold its lock themselves (`remove`, `stage` replacing its own partial copy)."""
    make_writable(path)
    shutil.rmtree(path)


def open_cache(ref: PathLike, *, check_hash: bool = True, roots: Roots = None) -> reader.Shards:
    """Open the cache ``ref`` names: a path, or a full hash or unique hash prefix (at least 4
    hex digits) of a cache in the shards roots (``roots``, else ``$SAEV_SHARDS_ROOT``, else
    ``$SAEV_SCRATCH/saev/shards``; see `resolve`). An existing path always wins.

    This is `saev_shards.open`: the reference is resolved here, then `reader.open` (which
    takes paths only) checks and opens the directory; see it for what is checked. A URL
    (``s3://bucket/root/<hash or prefix>``), or a hash (prefix) found only in a remote root,
    opens the remote cache (`reader.open_remote`).
    """
    check_reference(ref)
    from .remote_roots import find_cache

    if is_url(ref):
        return reader.open(find_cache(ref, roots), check_hash=check_hash)
    found: Path | str = Path(ref).absolute()
    if not Path(found).exists():  # a hash, a prefix, or a mistake: `find_cache` says which
        found = find_cache(ref, roots)
    return reader.open(found, check_hash=check_hash)


def open_quietly(path: Path, check_hash: bool = True) -> reader.Shards:
    """`open` without the protocol 2.1 warning: for copies of a source that already warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProtocolWarning)
        return reader.open(path, check_hash=check_hash)
