"""Seals: entries of the block cache checked once, not by every process.

Checked once, not by every process (docs/remote.md, "What the block cache trusts"): a process
that writes an entry from bytes it verified, or that hashes an entry and finds it right,
leaves a *seal* beside it, an empty file of its own whose name records the entry's inode
number and change time (``ctime``, in nanoseconds) as they were then. A process that opens
the entry later trusts it without reading a byte when it finds a seal of its own user for
the entry as it is now: a regular file of the entries' mode (0400, read-only) whose inode and
change time are those sealed. Any change to the entry's bytes since (a write, a truncation,
a file put in its place, a ``chmod`` to make it writable) sets a new change time, which no
user can set back, so the seal no longer matches and the entry is hashed again (and
discarded if it fails). Seals are per user: a seal counts only if the user opening the entry
owns it, so in a cache shared with a group each member checks another member's entries once
and seals them for themself (only once the entry has not changed for `SEAL_AFTER` seconds,
so that a change its owner makes later cannot share the sealed change time on a file system
whose clock ticks coarsely); no member can make a seal that another trusts. What a seal
cannot see (damage below the filesystem, a user with root's rights) is said in docs/remote.md.

A seal is named ``<key>.<uid>.<inode>.<ctime in ns>.seal`` (`seal_name`) and lives beside its
entry in ``blocks/<xx>/``; `scan_blocks` pairs entries with their seals for the size trim
(`blockcache.BlockCache.trim`), which removes an entry with its seals and the seals of
entries replaced or gone.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator

from .folders import OPEN_DIR, names, remove_name

SEAL_SUFFIX = ".seal"
#: Seconds since its last change (``ctime``) before another member's entry is sealed: a change
#: made later carries a later change time, even on a file system whose times are coarse.
SEAL_AFTER = 2.0


def seal_name(key: str, st: os.stat_result, uid: int | None = None) -> str:
    """The name of the seal user ``uid`` (this process's by default) leaves beside entry ``key``
    in the state ``st`` (``fstat``): ``<key>.<uid>.<inode>.<ctime in ns>.seal`` (module docstring)."""
    return f"{key}.{os.geteuid() if uid is None else uid}.{st.st_ino}.{st.st_ctime_ns}{SEAL_SUFFIX}"


def seal_matches(name: str, key: str, st: os.stat_result) -> bool:
    """Whether ``name`` is a seal (of any user) of entry ``key`` in the state ``st``."""
    parts = name[: -len(SEAL_SUFFIX)].split(".")
    return len(parts) == 4 and parts[0] == key and parts[2:] == [str(st.st_ino), str(st.st_ctime_ns)]


def is_sealed(dfd: int, key: str, st: os.stat_result, entry_mode: int) -> bool:
    """Whether entry ``key`` of the folder ``dfd``, found in the state ``st``, is read-only
    (``entry_mode``, the entries' mode) and carries this user's seal of that state; its seal then marked
    used now (trims remove the oldest first)."""
    if stat.S_IMODE(st.st_mode) != entry_mode:
        return False  # made writable since (or an earlier version's entry): hashed again
    name = seal_name(key, st)
    try:
        seal = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(seal.st_mode) or seal.st_uid != os.geteuid():
        return False
    if time.time() - seal.st_mtime > 1:  # at most one more system call a second
        with contextlib.suppress(OSError):
            os.utime(name, dir_fd=dfd, follow_symlinks=False)
    return True


def seal_if_checked(fd: int, dfd: int, key: str, st: os.stat_result, before: float, entry_mode: int) -> bool:
    """Seal entry ``key`` (open as ``fd``), just hashed and found right in the state ``st``
    (found at time ``before``, ahead of the hash), if it is still in that state and read-only;
    True once sealed. An entry of this user's of another mode (an earlier version's, or one
    made writable) is made read-only, and sealed by the next process that hashes it. Another
    member's entry is sealed only if it had not changed for `SEAL_AFTER` seconds before it
    was hashed: any change made after that, even in the same tick of a coarse clock, carries
    a later change time than the one sealed."""
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_ctime_ns, now.st_size) != (st.st_ino, st.st_ctime_ns, st.st_size):
            return False  # changed while it was hashed: checked again on the next open
        if stat.S_IMODE(now.st_mode) != entry_mode:
            if now.st_uid == os.geteuid():
                os.fchmod(fd, entry_mode)
            return False
        if now.st_uid != os.geteuid() and before - now.st_ctime < SEAL_AFTER:
            return False  # another member's entry changed just now: sealed once it has settled
        return write_seal(dfd, key, now, entry_mode)
    except OSError:
        return False


def write_seal(dfd: int, key: str, st: os.stat_result, entry_mode: int) -> bool:
    """Leave this user's seal of entry ``key`` in the state ``st`` in the folder ``dfd`` (an
    empty file, never through a link; anything else at its name is removed); False when it
    cannot be written (a full disk: the entry is hashed again when next opened)."""
    name = seal_name(key, st)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(name, flags, entry_mode, dir_fd=dfd)
        except FileExistsError:
            with contextlib.suppress(OSError):
                there = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(there.st_mode) and there.st_uid == os.geteuid():
                    return True  # sealed by another process of this user
            remove_name(dfd, name, None)  # a link, a FIFO, a folder: never what a link leads to
            continue
        except OSError:
            return False
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != entry_mode:
                os.fchmod(fd, entry_mode)  # the umask took the group's read of a shared cache
        except OSError:
            return False
        finally:
            os.close(fd)
        return True
    return False


@contextlib.contextmanager
def scan_blocks(blocks: int | None) -> Iterator[tuple[list[Found], list[tuple[int, str]]]]:
    """Every entry of the block cache's ``blocks/`` folder (its descriptor ``blocks``, None when
    there is none) as a `Found`, with its seals, and ``(folder descriptor, name)`` of every seal
    of no entry as it is now (its entry replaced or gone), the folders open (none through a
    link) until the block ends."""
    fds: list[int] = []
    out: list[Found] = []
    stale: list[tuple[int, str]] = []
    try:
        if blocks is not None:
            for sub in names(blocks):
                try:
                    sfd = os.open(sub, OPEN_DIR, dir_fd=blocks)
                except OSError:
                    continue  # not a folder (a link, a file): nothing of it is an entry
                fds.append(sfd)
                here: dict[str, tuple[Found, os.stat_result]] = {}
                seals: list[tuple[str, os.stat_result]] = []
                for name in names(sfd):
                    with contextlib.suppress(OSError):
                        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                        if name.endswith(SEAL_SUFFIX):
                            seals.append((name, st))
                        else:
                            here[name] = (Found(st.st_mtime, st.st_size, sub, name, sfd), st)
                for name, st in seals:
                    entry = here.get(name.split(".", 1)[0])
                    if entry is not None and seal_matches(name, entry[0].name, entry[1]):
                        entry[0].last_use = max(entry[0].last_use, st.st_mtime)
                        entry[0].seals.append(name)
                    else:
                        stale.append((sfd, name))
                out += [found for found, _ in here.values()]
        yield out, stale
    finally:
        for fd in fds:
            os.close(fd)


class Found:
    """An entry found by a scan of the cache: its last use (its own modification time or its
    seals', the latest), size, folder name, name, folder descriptor, and its seals' names."""

    __slots__ = ("dfd", "last_use", "name", "seals", "size", "sub")

    def __init__(self, last_use: float, size: int, sub: str, name: str, dfd: int) -> None:
        self.last_use = last_use
        self.size = size
        self.sub = sub
        self.name = name
        self.dfd = dfd
        self.seals: list[str] = []
