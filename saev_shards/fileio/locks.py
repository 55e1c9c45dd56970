"""Advisory ``flock`` locks taken without waiting: on a file descriptor (`try_flock`), on a
lock file or folder that its holder may delete (`take_lock`), and on a published cache's
read-only folder itself (`hold_folder`).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


def try_flock(fd: int, *, shared: bool = False) -> bool:
    """Take an advisory ``flock`` on ``fd`` without waiting; False if another process holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


#: flock errors that mean "this filesystem does not lock" (some NFS mounts), not "held".
NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL, errno.ENOSYS})


def hold_folder(path: Path, *, shared: bool) -> int | None:
    """Open the folder ``path`` and ``flock`` it without waiting (shared or exclusive); its fd,
    or None when the lock is not taken: another process holds it (exclusively, for a shared
    request), the filesystem does not lock, or the folder cannot be opened (another user's,
    or gone). Published caches are read-only folders: their lock is the folder itself, never
    a file inside. The caller closes the fd to release the lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        taken = try_flock(fd, shared=shared)
    except OSError as err:
        if err.errno not in NO_FLOCK_ERRNOS:
            os.close(fd)
            raise
        taken = False
    if not taken:
        os.close(fd)
        return None
    return fd


def take_lock(path: Path, *, shared: bool = False, directory: bool = False) -> int | None:
    """Lock ``path`` with ``flock`` without waiting: its open fd, or None if another process holds it.

    ``path`` is a lock file (created if missing) or, with ``directory``, a folder (created if
    missing). Whoever holds the lock exclusively may delete ``path`` before releasing it;
    so after locking, this checks that ``path`` still names what was locked, and otherwise
    starts over with whatever is there now. A lock returned here therefore belongs to the
    file or folder at ``path``, which nobody else can delete until it is released.
    """
    while True:
        if directory:
            os.makedirs(path, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:  # deleted by its holder between the two calls
                continue
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not try_flock(fd, shared=shared):
                os.close(fd)
                return None
            locked = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino):
            return fd
        os.close(fd)  # deleted or replaced while we waited: lock what is there now
