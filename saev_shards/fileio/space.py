"""Disk space: what is free (`free_bytes`), what files occupy (`bytes_on_disk`), refusing up
front a write that cannot fit (`check_free_space`), and a full disk turned into a
`DiskFullError` that names the file (`naming_disk_full`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import DiskFullError

#: Errors that mean "no room for these bytes": the filesystem is full, or the user's quota is.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Set to 1 to skip the up-front free-space checks of dump and stage (`check_free_space`).
NO_SPACE_CHECK_ENV = "SAEV_SHARDS_NO_SPACE_CHECK"


def _statvfs(path: Path) -> os.statvfs_result | None:
    """statvfs of the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return os.statvfs(path)
    except OSError:
        return None


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged user may still write on the filesystem holding ``path`` (or
    its nearest existing parent); None if the filesystem does not say."""
    st = _statvfs(path)
    return None if st is None else st.f_bavail * st.f_frsize


def bytes_on_disk(sizes: Iterable[int], folder: Path) -> int:
    """What files of these sizes occupy on the filesystem holding ``folder``: each rounded
    up to its allocation unit (a cache of many small parts takes more than its bytes)."""
    st = _statvfs(folder)
    unit = st.f_frsize if st is not None and st.f_frsize > 0 else 4096
    return sum(-(-n // unit) * unit for n in sizes)


def disk_full_error(
    path: Path, needed: int | None, err_no: int = errno.ENOSPC, note: str = "", *, at_least: bool = False
) -> DiskFullError:
    """The `DiskFullError` for ``path``: the bytes it needs in all (``at_least``: a lower
    bound, for files whose size is known only at the end), what is free, and ``note``."""
    free = free_bytes(path)
    what = "disk quota exceeded" if err_no == errno.EDQUOT else "no space left on device"
    if needed is None:
        need = "its size is not known in advance"
    else:
        need = f"it needs at least {needed:,} bytes" if at_least else f"it needs {needed:,} bytes in all"
    have = f"found {free:,} free on its filesystem" if free is not None else "free space unknown"
    message = f"{path}: {what} while writing it: {need}, {have}{note}"
    return DiskFullError(message, path=str(path), needed=needed, free=free, err_no=err_no)


@contextlib.contextmanager
def naming_disk_full(
    path: Path, needed: int | None = None, note: str = "", *, at_least: bool = False
) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT) inside the block into `DiskFullError` naming ``path``
    (arguments as for `disk_full_error`)."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise disk_full_error(path, needed, err.errno, note, at_least=at_least) from err


def check_free_space(folder: Path, needed: int, what: str, override: str) -> None:
    """Refuse, before anything is written, to write ``needed`` bytes into ``folder`` when
    fewer are free: `DiskFullError` naming ``what``, both sizes and ``override`` (how to
    skip the check). Skipped when the filesystem reports no sizes or when
    ``$SAEV_SHARDS_NO_SPACE_CHECK`` is 1."""
    if os.environ.get(NO_SPACE_CHECK_ENV, "") == "1":
        return
    free = free_bytes(folder)
    if free is None or needed <= free:
        return
    raise DiskFullError(
        f"{folder}: {what} needs {needed:,} bytes, found {free:,} free on its filesystem; nothing was "
        f"written. Free some space or choose another folder; if you know it fits (e.g. the filesystem "
        f"compresses), {override} or set {NO_SPACE_CHECK_ENV}=1",
        path=str(folder),
        needed=needed,
        free=free,
    )
