"""Folders of this machine handled through descriptors, never through a link, for the block
cache (`blockcache`) and the JSON files of remote caches: each step opened relative to its
parent's descriptor with ``O_NOFOLLOW``, so that a link (or a file) at the name of a folder
is removed, the link itself and never what it leads to, and a real folder made in its place;
a lock file taken without blocking; a new file written with O_DIRECT where the filesystem
allows it; the privacy check of a folder (its owner, its modes, a group it is shared with on
purpose); and a folder in memory (`memory_folder`) for when no disk may be written.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import grp
import os
import pwd
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from ..errors import BlockCacheError
from ..fileio import DIRECT_ALIGN, file_kind, pwrite_direct, try_flock

#: Modes of folders, of files, and of entries (read-only once written): a private folder, and
#: one shared with its group on purpose (`check_folder`).
PRIVATE_MODES = (0o700, 0o600, 0o400)
SHARED_MODES = (0o2770, 0o660, 0o440)

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_folder(folder: Path, env: str) -> tuple[int, int, int]:
    """Make the block cache's folder (0700) or check the one there: a folder of this user's
    (made 0700 when its modes are looser), or one shared with a group on purpose. Returns its
    modes (`PRIVATE_MODES` or `SHARED_MODES`); `BlockCacheError` for anything else."""
    try:
        os.makedirs(folder.parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, PRIVATE_MODES[0])
        st = os.stat(folder)  # the folder itself may be reached through a link
    except OSError as err:
        if err.errno in (errno.ENOTDIR, errno.EEXIST):
            raise BlockCacheError(f"{folder}: cannot make the block cache's folder here: {err.strerror}") from None
        raise
    if not stat.S_ISDIR(st.st_mode):
        raise BlockCacheError(f"{folder}: expected a folder for the block cache, found {file_kind(st.st_mode)}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISGID and mode & 0o070 == 0o070:  # shared with its group on purpose
        if mode & 0o007:
            raise BlockCacheError(
                f"{folder}: a block cache shared with a group is open to every user too (mode {mode:o}): "
                f"chmod o-rwx {folder}, or set {env} to a folder of your own"
            )
        if st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
            raise BlockCacheError(
                f"{folder}: this block cache is shared with group {_group(st.st_gid)}, which you are not in: "
                f"set {env} to a folder of your own"
            )
        return SHARED_MODES
    if st.st_uid != os.geteuid():
        raise BlockCacheError(
            f"{folder}: the block cache's folder belongs to user {_user(st.st_uid)}, not to you "
            f"(its blocks could be theirs to read and change): set {env} to a folder of your own, "
            f"or share one with a group on purpose (docs/remote.md: install -d -m 2770 -g GROUP DIR)"
        )
    if mode & 0o077:  # made by an earlier version (0755), or by hand: private from now on
        os.chmod(folder, PRIVATE_MODES[0])
    return PRIVATE_MODES


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} ({uid})"
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


def subdir(parent: int, name: str, mode: int | None) -> int | None:
    """A descriptor of folder ``name`` in the folder ``parent``, never through a link. With
    ``mode``, made when missing, and a link or anything else at its name removed (the link
    itself) and a folder made in its place; without, None when it is not a folder."""
    for _ in range(8):
        try:
            return os.open(name, OPEN_DIR, dir_fd=parent)
        except FileNotFoundError:
            if mode is None:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=parent)
                fd = os.open(name, OPEN_DIR, dir_fd=parent)
                if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                    os.fchmod(fd, mode)  # the umask took group permissions of a shared cache
                return fd
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if mode is None:
                return None
            remove_name(parent, name, None)  # a link, a file, a FIFO: never what a link leads to
    raise OSError(errno.EAGAIN, f"{name}: replaced again and again while being made a folder")


def remove_name(parent: int, name: str, bad: os.stat_result | None) -> None:
    """Remove ``name`` from the folder ``parent`` (a link itself, never what it leads to; a
    folder with what it holds), unless ``bad`` is given and another process has replaced it."""
    with contextlib.suppress(OSError):
        now = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if bad is not None and (now.st_dev, now.st_ino) != (bad.st_dev, bad.st_ino):
            return
        if stat.S_ISDIR(now.st_mode):
            shutil.rmtree(name, dir_fd=parent)  # descriptor-based: never follows a link inside
        else:
            os.unlink(name, dir_fd=parent)


def names(fd: int) -> list[str]:
    """The names in the open folder ``fd``."""
    try:
        with os.scandir(fd) as it:
            return [e.name for e in it]
    except OSError:
        return []


def lock_file(parent: int, name: str, mode: int) -> int | None:
    """``flock`` the file ``name`` of ``parent`` without waiting (never through a link): its
    descriptor, or None if another process holds it."""
    for _ in range(8):
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, mode, dir_fd=parent)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            remove_name(parent, name, None)
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO opened without blocking
            os.close(fd)
            remove_name(parent, name, None)
            continue
        if try_flock(fd):
            return fd
        os.close(fd)
        return None
    return None


def write_new_file(fd: int, view: memoryview) -> None:
    """Write a new entry's bytes into ``fd`` (a new temporary file): whole 4 KiB blocks with
    O_DIRECT where the filesystem allows it and ``view`` is page-aligned (the pooled buffers of
    `units` are), so that storing a block costs no copy into the page cache and never pushes
    out what the node's readers have cached; the rest buffered."""
    direct = _reopen_direct(fd) if view.nbytes >= DIRECT_ALIGN else None
    try:
        pwrite_direct(direct, fd, view, 0)
    finally:
        if direct is not None:
            os.close(direct)


def _reopen_direct(fd: int) -> int | None:
    """The file open as ``fd`` opened again for writing with O_DIRECT (through ``/proc``: the
    very file, whatever its folder's name leads to now); None where that is refused (tmpfs,
    some network filesystems, systems without O_DIRECT or ``/proc``)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None


# The folder in memory: JSON files of remote caches when no disk cache can hold them.

_MEMORY_PREFIX = "saev-shards-"
_MEMORY: dict[int, Path] = {}
_MEMORY_LOCK = threading.Lock()


def memory_folder() -> Path:
    """A folder private to this process in memory (``/dev/shm``, else the temporary folder),
    removed when the process ends: where the JSON files of remote caches go when the block
    cache is `BlockCache.disabled` or cannot be written (a full disk). Folders left by killed
    processes of this user are removed when the next one is made."""
    pid = os.getpid()
    with _MEMORY_LOCK:
        folder = _MEMORY.get(pid)
        if folder is None or not folder.is_dir():
            shm = Path("/dev/shm")  # noqa: S108 - a private folder made in it by mkdtemp (0700)
            base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
            folder = Path(tempfile.mkdtemp(prefix=f"{_MEMORY_PREFIX}{pid}-", dir=base))
            _MEMORY[pid] = folder
            atexit.register(_remove_memory_folder, folder, pid)
            _remove_stale(folder.parent)
    return folder


def _remove_memory_folder(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # a forked child runs its parent's exit handlers too
        shutil.rmtree(folder, ignore_errors=True)


def _remove_stale(base: Path) -> None:
    """Remove the memory folders of this user's processes that are gone."""
    for name in _names_in(base):
        if not name.startswith(_MEMORY_PREFIX):
            continue
        pid_text = name[len(_MEMORY_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        path = base / name
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or _alive(int(pid_text)):
                continue
            shutil.rmtree(path, ignore_errors=True)


def _names_in(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
