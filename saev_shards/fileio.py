"""File I/O primitives shared by the writer, the reader and the store.

Durable small files (`write_file_atomic`, `fsync_dir`), streaming copies and digests in
large sequential chunks (`stream`, `hash_file`), exact positional reads and writes
(`pread_exact`, `pwrite_all`), writes that bypass the page cache where the filesystem
allows it (`open_direct`, `pwrite_direct`, `aligned_buffer`), opening a file only if it is a
regular one (`open_regular`), advisory locks (`try_flock`, `take_lock`, `hold_folder`), publishing a
finished directory under its final name after checking exactly what it holds
(`publish_dir`), disk-full errors that name the file (`naming_disk_full`,
`check_free_space`) and the named points where tests stop or pause a process
(`fault_point`). Nothing here knows about caches: the protocol's rules live in the
modules that call these.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import xxhash

from .errors import DiskFullError, FileSizeError, NotRegularFileError, WriterError

#: Bytes per read when hashing or copying files: large sequential I/O.
IO_CHUNK = 8 << 20
#: Modes of a published cache: files read-only for everyone, the folder read-only and listable.
READ_ONLY_FILE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444
READ_ONLY_DIR = 0o555
#: Errors that mean "no room for these bytes": the filesystem is full, or the user's quota is.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Set to 1 to skip the up-front free-space checks of dump and stage (`check_free_space`).
NO_SPACE_CHECK_ENV = "SAEV_SHARDS_NO_SPACE_CHECK"

#: Test-only: called as ``fault_hook(name, index)`` at every `fault_point`, to kill or
#: pause the process there (the crash and race suites). None in normal use.
fault_hook: Callable[[str, int], None] | None = None


def fault_point(name: str, index: int = -1) -> None:
    """A named step of writing or publishing (``index``: the shard or file it concerns).

    Does nothing unless a test has set `fault_hook`; the points sit at shard granularity
    or coarser, so they cost nothing measurable.
    """
    if fault_hook is not None:
        fault_hook(name, index)


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...


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


class BlockHasher:
    """xxh3_128 of a stream of bytes, of the whole and (with a ``block_size``) of every
    ``block_size`` bytes from its start: a hasher for `stream` and the writer's files, so
    the digests of the blocks cost no second read."""

    def __init__(self, block_size: int | None = None) -> None:
        self.whole = xxhash.xxh3_128()
        self.block_size = block_size
        self._blocks: list[str] = []
        self._block = xxhash.xxh3_128()
        self._fill = 0  # bytes of the current block hashed so far

    def update(self, data: Any) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.whole.update(view)
        size = self.block_size
        if size is None:
            return
        while view.nbytes:
            n = min(size - self._fill, view.nbytes)
            self._block.update(view[:n])
            self._fill += n
            view = view[n:]
            if self._fill == size:
                self._blocks.append(self._block.hexdigest())
                self._block = xxhash.xxh3_128()
                self._fill = 0

    def hexdigest(self) -> str:
        """Digest of every byte so far."""
        return self.whole.hexdigest()

    def block_hexdigests(self) -> list[str]:
        """Digest of each block so far, the last one as far as it goes ([] before any byte)."""
        return self._blocks + ([self._block.hexdigest()] if self._fill else [])


def hash_file(
    path: Path,
    progress: Callable[[int], None] | None = None,
    *,
    regular_only: bool = False,
    buffer: memoryview | None = None,
    hasher: BlockHasher | None = None,
) -> tuple[int, str]:
    """``(nbytes, xxh3_128 hex)`` of a file, read in large sequential chunks.

    ``regular_only``: open it with `open_regular` (`NotRegularFileError` for a link, a FIFO...).
    ``buffer``: reuse one across files (a fresh `IO_CHUNK` buffer costs more than hashing a small file).
    ``hasher``: a fresh `BlockHasher` to hash with, for the digests of the file's blocks too.
    """
    h = BlockHasher() if hasher is None else hasher
    with open_regular(path) if regular_only else open(path, "rb", buffering=0) as f:
        total = stream(f, hasher=h, progress=progress, buffer=buffer)
    return total, h.hexdigest()


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
    than in 4 KiB ones (scripts/bench_remote.py, the remote_bounds table)."""
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


def freeze(folder: Path) -> None:
    """Make every entry of ``folder`` read-only (0444); the folder itself is left writable."""
    for entry in os.scandir(folder):
        os.chmod(entry.path, READ_ONLY_FILE, follow_symlinks=False)


def check_listing(folder: Path, expected: Mapping[str, int]) -> list[str]:
    """Problems with ``folder`` holding exactly ``expected`` (name -> size) as regular files."""
    problems = []
    found: dict[str, os.stat_result] = {}
    for entry in os.scandir(folder):
        found[entry.name] = entry.stat(follow_symlinks=False)
    for name, size in sorted(expected.items()):
        st = found.get(name)
        if st is None:
            problems.append(f"{folder / name}: missing")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{folder / name}: expected a regular file, found {stat.filemode(st.st_mode)}")
        elif st.st_size != size:
            problems.append(f"{folder / name}: expected {size} bytes, found {st.st_size}")
    problems.extend(f"{folder / name}: not expected here" for name in sorted(found.keys() - expected.keys()))
    return problems


def publish_dir(staging: Path, final: Path, durable: bool = True, *, expected: Mapping[str, int]) -> bool:
    """Check, freeze and rename ``staging`` to ``final``, read-only (files 0444, folder 0555).

    ``staging`` must hold exactly the regular files ``expected`` lists (name -> size), and
    nothing else; otherwise `WriterError` lists every difference and nothing is renamed.
    The rename is the last step: whatever is at ``final`` is complete and read-only.
    Returns False, renaming nothing, when ``final`` already exists (someone else published
    the same name meanwhile); the caller decides whether that is an error.
    """
    problems = check_listing(staging, expected)
    if problems:
        raise WriterError(f"{staging}: refusing to publish it as {final}:\n  " + "\n  ".join(problems[:50]))
    fault_point("publish-checked")
    freeze(staging)
    # Linux renames a read-only folder within one parent (only moving it to another
    # parent needs write permission on it, to update ".."), so it is frozen beforehand.
    os.chmod(staging, READ_ONLY_DIR)
    if durable:
        fsync_dir(staging)
    fault_point("publish-frozen")
    try:
        os.rename(staging, final)
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    fault_point("published")
    if durable:
        fsync_dir(final.parent)
    return True


def make_owner_writable(folder: Path) -> None:
    """Give ``folder`` itself back its owner's write permission (to add or delete entries)."""
    mode = stat.S_IMODE(os.lstat(folder).st_mode)
    if mode & stat.S_IRWXU != stat.S_IRWXU:
        os.chmod(folder, mode | stat.S_IRWXU)


def make_writable(folder: Path) -> None:
    """Undo a published folder's read-only modes (0555 folder, 0444 files) for its owner."""
    make_owner_writable(folder)
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


class _suppress_os_errors:
    """Ignore `OSError` (all of them, or only the given errnos)."""

    def __init__(self, *errnos: int) -> None:
        self.errnos = errnos

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError) and (not self.errnos or exc.errno in self.errnos)
