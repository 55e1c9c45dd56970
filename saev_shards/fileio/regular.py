"""Opening a file only if it is a regular one, never through a link, and naming what else a
path is (`open_regular`, `file_kind`): a cache's files are read through these.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from ..errors import NotRegularFileError


def open_regular(path: Path, *, follow_links: bool = False) -> io.FileIO:
    """Open ``path`` for unbuffered reading only if it is a regular file, never through a symlink.

    Raises `NotRegularFileError` naming what was found instead. ``lstat`` first, so a FIFO
    or a device is never opened at all (opening a FIFO blocks until a writer appears); the
    open itself refuses links (``O_NOFOLLOW``), never blocks (``O_NONBLOCK``) and is checked
    with ``fstat`` to be the file just inspected.

    ``follow_links``: a symbolic link is followed (``stat`` instead of ``lstat``), and what
    it leads to must be a regular file (converter sources are often linked in; a cache's
    files never are).
    """
    before = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        linked = " (through a symbolic link)" if follow_links and os.path.islink(path) else ""
        raise NotRegularFileError(f"{path}: expected a regular file, found {file_kind(before.st_mode)}{linked}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW))
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_links:  # replaced by a link since the lstat
            raise NotRegularFileError(f"{path}: expected a regular file, found a symbolic link") from None
        raise
    f = io.FileIO(fd, "rb", closefd=True)
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        f.close()
        raise NotRegularFileError(f"{path}: replaced by {file_kind(after.st_mode)} while being opened")
    return f


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, for messages: ``a directory``, ``a symbolic link``, ``a FIFO``..."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), f"a file of mode {mode:o}")
