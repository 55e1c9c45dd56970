"""Exact positional reads and writes (`pread_exact`, `pwrite_all`) and writes that bypass the
page cache where the filesystem allows it (`open_direct`, `pwrite_direct`, `aligned_buffer`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import FileSizeError


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd``."""
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


#: The alignment O_DIRECT needs (offsets, lengths and memory): the largest logical block size
#: of the disks in use.
DIRECT_ALIGN = 4096


#: Buffers at least this large are backed by transparent huge pages where the system allows it.
HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (what O_DIRECT writes need), at least one page; private
    to the process (shared anonymous memory, mmap's default, costs more to fault in), and in
    transparent huge pages from `HUGE_PAGE` bytes on where the system allows it: fresh memory
    is faulted in per page, and a 16 MiB buffer faults in several times faster in 2 MiB pages
    than in 4 KiB ones (benchmarks/remote.py, the remote_bounds table)."""
    buffer = mmap.mmap(-1, max(nbytes, DIRECT_ALIGN), flags=mmap.MAP_PRIVATE)
    if nbytes >= HUGE_PAGE:
        with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, as before
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def open_direct(path: Path) -> int | None:
    """``path`` opened for writing with O_DIRECT (the disk's rate, no page-cache copy or
    pollution); None where the system or filesystem refuses it (tmpfs, some network
    filesystems, systems without O_DIRECT)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None


def pwrite_direct(direct_fd: int | None, fd: int, view: memoryview, offset: int) -> bool:
    """Write ``view`` at ``offset`` (a multiple of `DIRECT_ALIGN`): its whole aligned blocks
    through ``direct_fd`` (O_DIRECT, from page-aligned memory), the rest through ``fd`` (the
    same file, buffered). Where O_DIRECT refuses the request (EINVAL: memory or a filesystem
    it does not suit), or without ``direct_fd``, everything goes through ``fd``. Returns
    whether the aligned part went through O_DIRECT."""
    aligned = view.nbytes - view.nbytes % DIRECT_ALIGN
    direct = direct_fd is not None and aligned > 0 and offset % DIRECT_ALIGN == 0
    if direct:
        assert direct_fd is not None
        try:
            pwrite_all(direct_fd, view[:aligned], offset)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            direct = False
    done = aligned if direct else 0
    pwrite_all(fd, view[done:], offset + done)
    return direct


def pread_exact(
    fd: int, view: memoryview, offset: int, preadv: Callable[[int, list[memoryview], int], int] = os.preadv
) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; `FileSizeError` if the file ends first.

    ``preadv``: how to read (a remote cache's storage reads through its own, `Shards.files`)."""
    while view.nbytes:
        n = preadv(fd, [view], offset)
        if n == 0:
            raise FileSizeError(f"unexpected end of file at byte {offset} (file truncated after open?)")
        view = view[n:]
        offset += n
