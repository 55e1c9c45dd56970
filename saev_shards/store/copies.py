"""Verified staging copies: a cache copied to local disk, every checksum verified, atomically and resumably."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from .. import reader
from ..errors import (
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    ShardsError,
    WriterBusyError,
)
from ..fileio import (
    IO_CHUNK,
    bytes_on_disk,
    check_free_space,
    fault_point,
    hash_file,
    make_writable,
    naming_disk_full,
    publish_dir,
    stream,
    take_lock,
    write_all,
    write_file_atomic,
)
from ..progress import Progress
from ..protocol.common import MANIFEST_FILE, METADATA_FILE
from ..remote.client import requests_in_flight
from .caches import check_not_in_use, delete_folder, hold_exclusively, open_quietly, remove
from .remote import locate
from .roots import COPY_PREFIX, PathLike, Roots, _scan, local_roots, shards_roots, stage_root
from .sidecar import carry_sidecar

# --------------------------------------------------------------------------------------
# staging: a verified local copy


@dataclasses.dataclass
class StageReport:
    """What `copy_cache` did."""

    source: Path
    #: The published local copy.
    path: Path
    copied_files: int = 0
    copied_bytes: int = 0
    #: Files an interrupted copy left complete, re-hashed and kept.
    kept_files: int = 0
    #: Bytes found already copied and kept (whole files, and the verified start of resumed ones).
    kept_bytes: int = 0
    #: Files an interrupted copy left half-written, completed from where they stopped.
    resumed_files: int = 0
    #: Files found in the destination that failed verification and were copied again.
    recopied: list[str] = dataclasses.field(default_factory=list)
    #: Files with no recorded checksum (protocol 2.1 without checksums.json): sizes only.
    unverified: list[str] = dataclasses.field(default_factory=list)
    #: A complete, valid copy was already there; nothing was copied.
    already_staged: bool = False
    #: A published local copy was damaged (e.g. files purged) and has been repaired.
    repaired: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, copied: int = 0, kept: int = 0, resumed: int = 0) -> None:
        """Count one file: copied whole (``copied`` bytes), kept whole, or resumed (``resumed``
        bytes kept, ``copied`` appended). Safe from several threads."""
        with self._lock:
            if kept:
                self.kept_files += 1
                self.kept_bytes += kept
            elif resumed:
                self.resumed_files += 1
                self.kept_bytes += resumed
                self.copied_bytes += copied
            else:
                self.copied_files += 1
                self.copied_bytes += copied


def stage(
    ref: PathLike,
    dest: PathLike | None = None,
    *,
    roots: Roots = None,
    progress: bool | None = False,
    on_bytes: Callable[[int], None] | None = None,
    durable: bool = True,
    check_space: bool = True,
) -> reader.Shards:
    """Copy the cache ``ref`` names into ``dest`` (see `stage_root`) with every checksum
    verified, and open the local copy. See `copy_cache` for the details."""
    report = copy_cache(
        ref, dest, roots=roots, progress=progress, on_bytes=on_bytes, durable=durable, check_space=check_space
    )
    return open_quietly(report.path)


def pull(
    ref: PathLike,
    dest: PathLike | None = None,
    *,
    roots: Roots = None,
    progress: bool | None = False,
    on_bytes: Callable[[int], None] | None = None,
    durable: bool = True,
    check_space: bool = True,
) -> StageReport:
    """Copy the remote cache ``ref`` names (a URL, or a hash found in a remote root) into
    ``dest``, by default the first local shards root, exactly as `copy_cache` does: every
    byte checked against the manifest, atomic, resumable."""
    base = Path(dest) if dest is not None else shards_roots(local_roots(roots))[0].path
    return copy_cache(
        ref, base, roots=roots, progress=progress, on_bytes=on_bytes, durable=durable, check_space=check_space
    )


def copy_cache(
    ref: PathLike,
    dest: PathLike | None = None,
    *,
    roots: Roots = None,
    progress: bool | None = False,
    on_bytes: Callable[[int], None] | None = None,
    durable: bool = True,
    check_space: bool = True,
) -> StageReport:
    """Copy a cache to ``<dest>/<hash>``: verified, atomic and resumable.

    Files are copied into ``<dest>/.copying-<hash>/`` and hashed while they are written;
    each must match the size and xxh3_128 digest in the source manifest. Only when every
    file matches is the directory made read-only and renamed to ``<dest>/<hash>``.

    An interrupted copy resumes: complete files already there are re-hashed and kept,
    a half-written file is hashed up to where it stopped and completed, and anything that
    fails verification is copied again. A published local copy that no longer opens
    (a scratch purge deleted files) is repaired the same way. A source whose bytes do not
    match its own manifest raises `ChecksumMismatchError` naming the source file.

    Before copying anything, ``check_space`` refuses with `DiskFullError` when the bytes
    still to copy exceed the free space of ``dest``'s filesystem (skip the check with
    ``check_space=False`` or ``SAEV_SHARDS_NO_SPACE_CHECK=1``); a disk that fills up anyway
    raises `DiskFullError` naming the file, and running again after freeing space resumes.

    Statistics computed later for the source (its sidecar, `sidecar.carry_sidecar`) are
    copied beside the copy.
    """
    source = reader.open(locate(ref, roots))
    report = _copy_cache(source, stage_root(dest).path, progress, on_bytes, durable, check_space)
    carry_sidecar(source, report.path)  # statistics computed later travel with the cache
    return report


def _copy_cache(
    source: reader.Shards,
    base: Path,
    progress: bool | None,
    on_bytes: Callable[[int], None] | None,
    durable: bool,
    check_space: bool,
) -> StageReport:
    name = source.path.name
    final = base / name
    report = StageReport(source=source.path, path=final)
    if final.exists() and final.resolve() == source.path.resolve():
        report.already_staged = True
        return report
    base.mkdir(parents=True, exist_ok=True)
    partial = base / f"{COPY_PREFIX}{name}"
    if final.exists():
        try:
            open_quietly(final)
            report.already_staged = True
            return report
        except ShardsError:
            # A damaged local copy: move it back to the partial name and resume over it,
            # unless processes read it (CacheInUseError names them; nothing is touched).
            check_not_in_use(final, locked=_locked(final))
            make_writable(final)
            if partial.exists():
                remove(final)  # refused (CacheInUseError) while processes read the damaged copy
            else:
                os.rename(final, partial)
            report.repaired = True
    files = _files_to_copy(source)
    if check_space:  # before anything is written
        check_free_space(base, _bytes_missing(partial, files), f"staging {source.path}", "pass check_space=False")
    # The lock is the partial folder itself (local disk), which its holder removes or
    # renames: take_lock makes sure we hold the folder that is at that name now.
    lock_fd = take_lock(partial, directory=True)
    if lock_fd is None:
        raise WriterBusyError(f"{partial}: another process is copying this cache")
    try:
        if final.exists():  # another process finished while we waited for the folder
            delete_folder(partial)  # ours: we hold its lock
            report.already_staged = True
            return report
        make_writable(partial)  # a copy killed between freezing and its rename is read-only
        expected = _copy_files(source, files, partial, report, progress, on_bytes, durable)
        _publish(source, partial, final, durable, expected)
    finally:
        os.close(lock_fd)
    return report


def _locked(folder: Path) -> bool:
    """Whether another process holds the lock of ``folder`` (a reader of it)."""
    fd, busy = hold_exclusively(folder)
    if fd is not None:
        os.close(fd)
    return busy


def _files_to_copy(source: reader.Shards) -> list[tuple[str, int, str | None]]:
    """``(name, nbytes, xxh3_128 or None)`` of every data file a copy of ``source`` holds."""
    return list(source.manifest.files())  # with a 2.1 cache's empty shards: saev memmaps them


def _bytes_missing(partial: Path, files: list[tuple[str, int, str | None]]) -> int:
    """Bytes a copy into ``partial`` still needs on its filesystem (what files there hold
    counts as done), each file rounded up to the allocation unit."""
    full, have = [], []
    for fname, nbytes, _ in files:
        size = _size(partial / fname)
        full.append(nbytes)
        have.append(size if 0 <= size <= nbytes else 0)
    return bytes_on_disk(full, partial.parent) - bytes_on_disk(have, partial.parent)


def _copy_files(
    source: reader.Shards,
    files: list[tuple[str, int, str | None]],
    partial: Path,
    report: StageReport,
    progress: bool | None,
    on_bytes: Callable[[int], None] | None,
    durable: bool,
) -> dict[str, int]:
    """Copy ``files`` and the JSON files into ``partial``; returns what it then holds (name -> size)."""
    total = sum(n for _, n, _ in files)
    lock = threading.Lock()
    with Progress(total, f"stage {source.path.name[:12]}", enabled=progress) as bar:

        def tick(n: int) -> None:
            with lock:
                bar.update(n)
            if on_bytes is not None:
                on_bytes(n)

        def one(row: tuple[str, int, str | None]) -> None:
            fname, nbytes, digest = row
            dst = partial / fname
            if digest is None:
                with lock:
                    report.unverified.append(fname)
                _copy_file(source, fname, dst, nbytes, None, tick, 0, durable)
                report.add(copied=nbytes)
                return
            before = bar.done
            if _resume_file(source, fname, dst, nbytes, digest, report, tick, durable):
                return
            with lock:
                bar.total += bar.done - before  # bytes hashed in vain are read again
                report.recopied.append(fname)
            _copy_file(source, fname, dst, nbytes, digest, tick, 0, durable)
            report.add(copied=nbytes)

        if source.url is None:
            for row in files:
                one(row)
        else:  # a remote source: several files in flight, each one stream
            with ThreadPoolExecutor(max(1, min(requests_in_flight(), len(files))), "saev-pull") as pool:
                list(pool.map(one, files))
    expected = {fname: nbytes for fname, nbytes, _ in files}
    # The small JSON files go last: their presence never suggests the data is complete.
    sidecars = source.metadata.format.sidecar_names
    listing = () if source.metadata.format.manifest_file is None else (MANIFEST_FILE,)  # saev before 1.0.0: none
    for fname in (METADATA_FILE, *listing, *sidecars):
        src = source.path / fname
        if src.exists() or fname not in sidecars:
            data = src.read_bytes()
            write_file_atomic(partial / fname, data, durable)
            expected[fname] = len(data)
    for e in _scan(partial):
        if e.name not in expected:  # leftovers, e.g. a temporary file from an interrupted write
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
    return expected


def _resume_file(
    source: reader.Shards,
    fname: str,
    dst: Path,
    nbytes: int,
    digest: str,
    report: StageReport,
    tick: Callable[[int], None],
    durable: bool,
) -> bool:
    """Use what an interrupted copy left at ``dst``; True when ``dst`` now verifies."""
    have = _size(dst)
    if have < 0:
        _copy_file(source, fname, dst, nbytes, digest, tick, 0, durable)
        report.add(copied=nbytes)
        return True
    if have == nbytes:
        if hash_file(dst, tick)[1] == digest:
            report.add(kept=nbytes)
            return True
        return False
    if have > nbytes:
        return False
    # Half-written: hash what is there, append the rest; the whole file's digest decides.
    try:
        _copy_file(source, fname, dst, nbytes, digest, tick, have, durable)
    except ChecksumMismatchError:
        return False
    report.add(resumed=have, copied=nbytes - have)
    return True


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _copy_file(
    source: reader.Shards,
    fname: str,
    dst: Path,
    nbytes: int,
    digest: str | None,
    tick: Callable[[int], None],
    start: int,
    durable: bool,
) -> None:
    """Copy file ``fname`` of ``source`` to ``dst`` from byte ``start`` on (earlier bytes are
    kept and hashed), checking the size and, if given, the xxh3_128 digest of the whole file.
    A remote source is streamed from its server (`RemoteFiles.stream`)."""
    h = xxhash.xxh3_128()
    buf = memoryview(bytearray(IO_CHUNK))
    src = source.files.where(fname)
    note = "; what was copied is kept: free some space and stage again to resume"
    with naming_disk_full(dst, nbytes, note), open(dst, "r+b" if start else "wb", buffering=0) as out:
        if start:
            out.truncate(start)
            stream(out, None, h, tick, buf)
        remote_stream = getattr(source.files, "stream", None)
        if remote_stream is not None:
            for chunk in remote_stream(fname, start):
                view = memoryview(chunk)
                h.update(view)
                write_all(out, view)
                tick(view.nbytes)
        else:
            with open(source.path / fname, "rb", buffering=0) as inp:
                inp.seek(start)
                stream(inp, out, h, tick, buf)
        size = out.tell()
        if durable:
            os.fsync(out.fileno())
    fault_point("stage-copied")
    if size != nbytes:
        if remote_stream is not None and size > nbytes:  # the stream stops one byte past the size
            raise FileSizeError(f"{src}: expected {nbytes} bytes, found more (the server sends more than it holds)")
        raise FileSizeError(f"{src}: expected {nbytes} bytes, found {size} (the source changed while copying?)")
    found = h.hexdigest()
    if digest is not None and found != digest:
        if start:  # the kept start of the file was bad; the caller copies it again whole
            raise ChecksumMismatchError(f"{dst}: xxh3_128 expected {digest}, found {found}")
        os.unlink(dst)
        raise ChecksumMismatchError(
            f"{src}: xxh3_128 expected {digest}, found {found} while copying it; the source cache "
            f"is damaged (check it with: saev-shards verify {source.location})"
        )


def _publish(source: reader.Shards, partial: Path, final: Path, durable: bool, expected: dict[str, int]) -> None:
    """Check the copy opens as the same cache and holds exactly ``expected``, freeze it and
    rename it into place."""
    copy = open_quietly(partial, check_hash=False)
    found = copy.metadata.hash
    if copy.metadata.dialect != source.metadata.dialect:  # saev's 64-digit names are told by the name
        with contextlib.suppress(ShardsError):
            found = copy.metadata.replace(dialect=source.metadata.dialect).hash
    if found != final.name:
        raise HashMismatchError(f"{partial / METADATA_FILE}: expected hash {final.name}, found {found}")
    if not publish_dir(partial, final, durable, expected=expected):
        delete_folder(partial)  # another process published the same verified copy meanwhile (we hold its lock)
