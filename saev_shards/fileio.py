"""File I/O primitives shared by the writer, the reader and the store.

Durable small files (`write_file_atomic`, `fsync_dir`), streaming copies and digests in
large sequential chunks (`stream`, `hash_file`), exact positional reads and writes
(`pread_exact`, `pwrite_all`), opening a file only if it is a regular one
(`open_regular`), advisory locks (`try_flock`) and publishing a finished
directory under its final name (`publish_dir`). Nothing here knows about caches: the
protocol's rules live in the modules that call these.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import xxhash

from .errors import FileSizeError, NotRegularFileError

#: Bytes per read when hashing or copying files: large sequential I/O.
IO_CHUNK = 8 << 20
#: Modes of a published cache: files read-only for everyone, the folder read-only and listable.
READ_ONLY_FILE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444
READ_ONLY_DIR = 0o555


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` via a temporary name in the same folder and a rename."""
    # A unique temporary name: several writers may race to create the same file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_errors():
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def stream(
    src: Any,
    sink: Any | None = None,
    hasher: _Hasher | None = None,
    progress: Callable[[int], None] | None = None,
    buffer: memoryview | None = None,
) -> int:
    """Read the open binary file ``src`` from its position to its end in `IO_CHUNK` pieces.

    Every piece updates ``hasher`` (if given) and is written whole to ``sink`` (an open
    binary file, if given); ``progress`` is called with each piece's length. Returns the
    number of bytes read. Pass ``buffer`` to reuse one across calls.
    """
    view = buffer if buffer is not None else memoryview(bytearray(IO_CHUNK))
    total = 0
    while True:
        n = src.readinto(view)
        if not n:
            return total
        chunk = view[:n]
        if hasher is not None:
            hasher.update(chunk)
        if sink is not None:
            write_all(sink, chunk)
        total += n
        if progress is not None:
            progress(n)


def hash_file(
    path: Path,
    progress: Callable[[int], None] | None = None,
    *,
    regular_only: bool = False,
    buffer: memoryview | None = None,
) -> tuple[int, str]:
    """``(nbytes, xxh3_128 hex)`` of a file, read in large sequential chunks.

    ``regular_only``: open it with `open_regular` (`NotRegularFileError` for a link, a FIFO...).
    ``buffer``: reuse one across files (a fresh `IO_CHUNK` buffer costs more than hashing a small file).
    """
    h = xxhash.xxh3_128()
    with open_regular(path) if regular_only else open(path, "rb", buffering=0) as f:
        total = stream(f, hasher=h, progress=progress, buffer=buffer)
    return total, h.hexdigest()


def open_regular(path: Path) -> io.FileIO:
    """Open ``path`` for unbuffered reading only if it is a regular file, never through a symlink.

    Raises `NotRegularFileError` naming what was found instead. ``lstat`` first, so a FIFO
    or a device is never opened at all (opening a FIFO blocks until a writer appears); the
    open itself refuses links (``O_NOFOLLOW``), never blocks (``O_NONBLOCK``) and is checked
    with ``fstat`` to be the file just inspected.
    """
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise NotRegularFileError(f"{path}: expected a regular file, found {file_kind(before.st_mode)}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:  # replaced by a link since the lstat
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


def write_all(f: Any, view: memoryview) -> None:
    """Write all of ``view`` to the open binary file ``f`` (unbuffered writes may be short)."""
    while view.nbytes:
        n = f.write(view)
        view = view[n:]


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd``."""
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pread_exact(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; `FileSizeError` if the file ends first."""
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise FileSizeError(f"unexpected end of file at byte {offset} (file truncated after open?)")
        view = view[n:]
        offset += n


def try_flock(fd: int, *, shared: bool = False) -> bool:
    """Take an advisory ``flock`` on ``fd`` without waiting; False if another process holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def freeze(folder: Path) -> None:
    """Make every entry of ``folder`` read-only (0444); the folder itself is left writable."""
    for entry in os.scandir(folder):
        os.chmod(entry.path, READ_ONLY_FILE, follow_symlinks=False)


def publish_dir(staging: Path, final: Path, durable: bool = True) -> bool:
    """Freeze ``staging``, rename it to ``final`` and make that read-only (0555).

    Returns False, renaming nothing, when ``final`` already exists (someone else published
    the same name meanwhile); the caller decides whether that is an error.
    """
    freeze(staging)
    if durable:
        fsync_dir(staging)
    try:
        os.rename(staging, final)
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    os.chmod(final, READ_ONLY_DIR)
    if durable:
        fsync_dir(final.parent)
    return True


def make_writable(folder: Path) -> None:
    """Undo a published folder's read-only modes (0555 folder, 0444 files) for its owner."""
    os.chmod(folder, stat.S_IMODE(os.lstat(folder).st_mode) | stat.S_IRWXU)
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
            os.chmod(entry.path, mode | stat.S_IWUSR | stat.S_IRUSR)


def remove_path(path: Path) -> None:
    """Delete a file, a symlink or a whole folder; a missing path is not an error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with _suppress_os_errors(errno.ENOENT):
            path.unlink()


class _suppress_os_errors:
    """Ignore `OSError` (all of them, or only the given errnos)."""

    def __init__(self, *errnos: int) -> None:
        self.errnos = errnos

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError) and (not self.errnos or exc.errno in self.errnos)
