"""File I/O primitives shared by the writer, the reader and the store, one job per module.

* `durable`: small files made durable (`write_file_atomic`, `fsync_dir`);
* `hashing`: streaming copies and digests in large sequential chunks (`stream`,
  `BlockHasher`, `hash_file`);
* `direct`: exact positional reads and writes (`pread_exact`, `pwrite_all`) and writes that
  bypass the page cache where the filesystem allows it (`open_direct`, `pwrite_direct`,
  `aligned_buffer`);
* `regular`: opening a file only if it is a regular one (`open_regular`, `file_kind`);
* `locks`: advisory locks (`try_flock`, `take_lock`, `hold_folder`);
* `publish`: publishing a finished directory under its final name after checking exactly
  what it holds (`publish_dir`), and making it writable again;
* `space`: free space, and disk-full errors that name the file (`naming_disk_full`,
  `check_free_space`);
* `faults`: the named points where tests stop or pause a process (`fault_point`; the hook
  is `fault_hook`, below).

Nothing here knows about caches: the protocol's rules live in the modules that call these.
"""

from __future__ import annotations

from collections.abc import Callable

from .direct import DIRECT_ALIGN, HUGE_PAGE, aligned_buffer, open_direct, pread_exact, pwrite_all, pwrite_direct
from .durable import fsync_dir, write_file_atomic
from .faults import fault_point
from .hashing import IO_CHUNK, BlockHasher, hash_file, stream, write_all
from .locks import NO_FLOCK_ERRNOS, hold_folder, take_lock, try_flock
from .publish import (
    READ_ONLY_DIR,
    READ_ONLY_FILE,
    check_listing,
    freeze,
    make_owner_writable,
    make_writable,
    publish_dir,
    remove_path,
)
from .regular import file_kind, open_regular
from .space import (
    DISK_FULL_ERRNOS,
    NO_SPACE_CHECK_ENV,
    bytes_on_disk,
    check_free_space,
    disk_full_error,
    free_bytes,
    naming_disk_full,
)

#: Test-only: called as ``fault_hook(name, index)`` at every `fault_point`, to kill or
#: pause the process there (the crash and race suites). None in normal use.
fault_hook: Callable[[str, int], None] | None = None

__all__ = [
    "DIRECT_ALIGN",
    "DISK_FULL_ERRNOS",
    "HUGE_PAGE",
    "IO_CHUNK",
    "NO_FLOCK_ERRNOS",
    "NO_SPACE_CHECK_ENV",
    "READ_ONLY_DIR",
    "READ_ONLY_FILE",
    "BlockHasher",
    "aligned_buffer",
    "bytes_on_disk",
    "check_free_space",
    "check_listing",
    "disk_full_error",
    "fault_hook",
    "fault_point",
    "file_kind",
    "free_bytes",
    "freeze",
    "fsync_dir",
    "hash_file",
    "hold_folder",
    "make_owner_writable",
    "make_writable",
    "naming_disk_full",
    "open_direct",
    "open_regular",
    "pread_exact",
    "publish_dir",
    "pwrite_all",
    "pwrite_direct",
    "remove_path",
    "stream",
    "take_lock",
    "try_flock",
    "write_all",
    "write_file_atomic",
]
