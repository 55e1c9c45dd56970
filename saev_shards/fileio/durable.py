"""Small files made durable: written through a temporary name and a rename, with the folder
synced (`write_file_atomic`, `fsync_dir`); a full disk names the file (`saev_shards.fileio.space`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .space import naming_disk_full


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(
    path: Path,
    data: bytes,
    durable: bool = True,
    *,
    note: str = "",
    dir_fd: int | None = None,
    mode: int | None = None,
) -> None:
    """Write ``data`` to ``path`` via a temporary name in the same folder and a rename.

    A full disk raises `DiskFullError` naming ``path`` (``note`` appended: what to do about
    it) and leaves no temporary file. The temporary file is never opened through a link.
    ``dir_fd``: an open descriptor of the folder, and every name is taken relative to it
    (the folder cannot be swapped for a link between a check and the write). ``mode``: the
    new file's permissions, exactly (the umask's default when not given).
    """
    # A unique temporary name: several writers may race to create the same file.
    tmp_name = f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp: str | Path = tmp_name if dir_fd is not None else path.with_name(tmp_name)
    final: str | Path = path.name if dir_fd is not None else path
    try:
        with naming_disk_full(path, len(data), note):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            with open(os.open(tmp, flags, 0o600 if mode is not None else 0o666, dir_fd=dir_fd), "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with _suppress_os_errors():
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        if dir_fd is not None:
            os.fsync(dir_fd)
        else:
            fsync_dir(path.parent)


class _suppress_os_errors:
    """Ignore `OSError` (all of them, or only the given errnos)."""

    def __init__(self, *errnos: int) -> None:
        self.errnos = errnos

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError) and (not self.errnos or exc.errno in self.errnos)
