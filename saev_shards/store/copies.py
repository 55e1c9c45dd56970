"""Verified copies of a cache: into a local folder (`stage`, `pull`, `copy_cache`) and into a
remote shards root (`push`); each atomic and resumable, every byte hashed on its way and
checked against the manifest before the copy is published (`storage.transfer`).

A local copy is assembled in ``<dest>/.copying-<hash>/`` and renamed to ``<dest>/<hash>``
once every file matches. A remote copy is published when its shards.json exists: `push`
uploads the data files first (several at once, each a multipart upload with parts in
parallel), then blocks.json and the statistics sidecar, then metadata.json, and shards.json
last. A killed copy leaves what no reader takes for a cache, and running it again transfers
only what is missing. Where the source is makes no difference here: its `Files` streams it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict, Unpack

from .. import reader
from ..errors import (
    CacheRefError,
    ChecksumMismatchError,
    HashMismatchError,
    ManifestError,
    RemoteError,
    ShardsError,
    WriterBusyError,
)
from ..fileio import (
    bytes_on_disk,
    check_free_space,
    fault_point,
    make_writable,
    publish_dir,
    take_lock,
    write_file_atomic,
)
from ..progress import Progress
from ..protocol.common import MANIFEST_FILE, METADATA_FILE
from ..reader.sidecars import SIDECAR_DIR, sidecar_path
from ..storage.client import Client
from ..storage.transfer import (
    PUSH_FILES,
    Row,
    TransferReport,
    check_sizes,
    copy_file,
    differing,
    json_files,
    resume_file,
    same_json,
    size_of,
    upload_file,
)
from ..storage.url import is_url, join_url
from .caches import check_not_in_use, delete_folder, hold_exclusively, open_quietly, remove
from .remote_roots import find_cache
from .roots import COPY_PREFIX, PathLike, Roots, _scan, local_roots, resolve, shards_roots, stage_root
from .sidecar import carry_sidecar

#: Earlier names of `TransferReport`: what `copy_cache` / `pull` and `push` did.
StageReport = TransferReport
PushReport = TransferReport


@dataclasses.dataclass(frozen=True)
class CopyOptions:
    """How `stage`, `pull` and `copy_cache` copy; each also takes these as keywords
    (``stage(ref, progress=True)``), which override ``options``."""

    #: Shards roots to find the cache in (`roots.resolve`; remote ones too: `find_cache`).
    roots: Roots = None
    #: Show a progress bar (None: when stderr is a terminal).
    progress: bool | None = False
    #: Called with the length of every piece copied (and of what is re-hashed when resuming).
    on_bytes: Callable[[int], None] | None = None
    #: fsync each file before the copy is published (False for scratch copies and tests).
    durable: bool = True
    #: Refuse with `DiskFullError` before copying anything when the bytes still to copy exceed
    #: the free space of the destination (also ``SAEV_SHARDS_NO_SPACE_CHECK=1``).
    check_space: bool = True


class CopyKeywords(TypedDict, total=False):
    """`CopyOptions` as keywords (their types, for type checkers)."""

    roots: Roots
    progress: bool | None
    on_bytes: Callable[[int], None] | None
    durable: bool
    check_space: bool


def _options(options: CopyOptions | None, keywords: CopyKeywords) -> CopyOptions:
    return dataclasses.replace(options or CopyOptions(), **keywords)


def stage(
    ref: PathLike, dest: PathLike | None = None, *, options: CopyOptions | None = None, **keywords: Unpack[CopyKeywords]
) -> reader.Shards:
    """Copy the cache ``ref`` names into ``dest`` (see `stage_root`) with every checksum
    verified, and open the local copy. See `copy_cache` for the details."""
    return open_quietly(copy_cache(ref, dest, options=_options(options, keywords)).path)


def pull(
    ref: PathLike, dest: PathLike | None = None, *, options: CopyOptions | None = None, **keywords: Unpack[CopyKeywords]
) -> TransferReport:
    """Copy the remote cache ``ref`` names (a URL, or a hash found in a remote root) into
    ``dest``, by default the first local shards root, exactly as `copy_cache` does: every
    byte checked against the manifest, atomic, resumable."""
    opts = _options(options, keywords)
    base = Path(dest) if dest is not None else shards_roots(local_roots(opts.roots))[0].path
    return copy_cache(ref, base, options=opts)


def copy_cache(
    ref: PathLike, dest: PathLike | None = None, *, options: CopyOptions | None = None, **keywords: Unpack[CopyKeywords]
) -> TransferReport:
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
    copied beside the copy. `CopyOptions` lists the keywords.
    """
    opts = _options(options, keywords)
    source = reader.open(find_cache(ref, opts.roots))
    report = _copy_cache(source, stage_root(dest).path, opts)
    carry_sidecar(source, report.path)  # statistics computed later travel with the cache
    return report


def _copy_cache(source: reader.Shards, base: Path, opts: CopyOptions) -> TransferReport:
    name = source.path.name
    final = base / name
    report = TransferReport(source=source.path, dest=final)
    if final.exists() and final.resolve() == source.path.resolve():
        report.already_there = True
        return report
    base.mkdir(parents=True, exist_ok=True)
    partial = base / f"{COPY_PREFIX}{name}"
    if final.exists():
        try:
            open_quietly(final)
            report.already_there = True
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
    rows = list(source.manifest.files())  # with a 2.1 cache's empty shards: saev memmaps them
    if opts.check_space:  # before anything is written
        check_free_space(base, _bytes_missing(partial, rows), f"staging {source.path}", "pass check_space=False")
    # The lock is the partial folder itself (local disk), which its holder removes or
    # renames: take_lock makes sure we hold the folder that is at that name now.
    lock_fd = take_lock(partial, directory=True)
    if lock_fd is None:
        raise WriterBusyError(f"{partial}: another process is copying this cache")
    try:
        if final.exists():  # another process finished while we waited for the folder
            delete_folder(partial)  # ours: we hold its lock
            report.already_there = True
            return report
        make_writable(partial)  # a copy killed between freezing and its rename is read-only
        expected = _copy_files(source, rows, partial, report, opts)
        _publish(source, partial, final, opts.durable, expected)
    finally:
        os.close(lock_fd)
    return report


def _locked(folder: Path) -> bool:
    """Whether another process holds the lock of ``folder`` (a reader of it)."""
    fd, busy = hold_exclusively(folder)
    if fd is not None:
        os.close(fd)
    return busy


def _bytes_missing(partial: Path, rows: list[Row]) -> int:
    """Bytes a copy into ``partial`` still needs on its filesystem (what files there hold
    counts as done), each file rounded up to the allocation unit."""
    full, have = [], []
    for fname, nbytes, _ in rows:
        size = size_of(partial / fname)
        full.append(nbytes)
        have.append(size if 0 <= size <= nbytes else 0)
    return bytes_on_disk(full, partial.parent) - bytes_on_disk(have, partial.parent)


def _copy_files(
    source: reader.Shards, rows: list[Row], partial: Path, report: TransferReport, opts: CopyOptions
) -> dict[str, int]:
    """Copy ``rows`` and the JSON files into ``partial``; returns what it then holds (name -> size)."""
    total = sum(n for _, n, _ in rows)
    lock = threading.Lock()
    files = source.files
    with Progress(total, f"stage {source.path.name[:12]}", enabled=opts.progress) as bar:

        def tick(n: int) -> None:
            with lock:
                bar.update(n)
            if opts.on_bytes is not None:
                opts.on_bytes(n)

        def one(row: Row) -> None:
            fname, nbytes, digest = row
            dst = partial / fname
            if digest is None:
                with lock:
                    report.unverified.append(fname)
                copy_file(files, row, dst, tick, durable=opts.durable)
                report.add(copied=nbytes)
                return
            before = bar.done
            if resume_file(files, row, dst, report, tick, opts.durable):
                return
            with lock:
                bar.total += bar.done - before  # bytes hashed in vain are read again
                report.recopied.append(fname)
            copy_file(files, row, dst, tick, durable=opts.durable)
            report.add(copied=nbytes)

        workers = max(1, min(files.streams, len(rows)))  # a server's files: several in flight, each one stream
        if workers == 1:
            for row in rows:
                one(row)
        else:
            with ThreadPoolExecutor(workers, "saev-pull") as pool:
                list(pool.map(one, rows))
    expected = {fname: nbytes for fname, nbytes, _ in rows}
    # The small JSON files go last: their presence never suggests the data is complete.
    sidecars = source.metadata.rules.sidecar_names
    listing = () if source.metadata.rules.manifest_file is None else (MANIFEST_FILE,)  # saev before 1.0.0: none
    for fname in (METADATA_FILE, *listing, *sidecars):
        src = source.path / fname
        if src.exists() or fname not in sidecars:
            data = src.read_bytes()
            write_file_atomic(partial / fname, data, opts.durable)
            expected[fname] = len(data)
    for e in _scan(partial):
        if e.name not in expected:  # leftovers, e.g. a temporary file from an interrupted write
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
    return expected


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


def push(
    ref: PathLike,
    root_url: str,
    *,
    roots: Roots = None,
    verify: bool = True,
    progress: bool | None = False,
    on_bytes: Callable[[int], None] | None = None,
) -> TransferReport:
    """Publish the local cache ``ref`` names as ``<root_url>/<HASH>`` (module docstring).

    Every byte uploaded is hashed as it is read and must match the manifest (a damaged local
    file raises `ChecksumMismatchError` naming it, and what was uploaded of it is deleted);
    nothing local is changed. Objects already there (an interrupted push, or a damaged
    earlier copy) are read back and checked against the manifest first: those of the wrong
    size or with other bytes are uploaded again, the copy unpublished meanwhile, so a push
    repairs a damaged remote copy. ``verify``: what was uploaded is read back and checked too,
    before shards.json (the commit point) is written; without it, the sizes the server lists
    are checked. A remote copy that does not check out is never published.
    """
    if not is_url(root_url):
        raise CacheRefError(f"push: expected a remote shards root (s3://bucket/prefix, ...), found {root_url!r}")
    source = reader.open(resolve(ref, roots))
    md = source.metadata
    if md.rules.legacy:
        raise ManifestError(
            f"{source.path}: a protocol {md.protocol} cache ({md.rules.summary}): remote caches are protocol 3 "
            f"only; convert it first (`saev-shards convert {source.path} --to 3.0`)"
        )
    url = join_url(root_url, md.hash)
    report = TransferReport(source=source.path, dest=url)
    client = Client(url)
    if not client.can_list:
        raise RemoteError(
            f"{root_url}: push needs an object store (s3://, gs://, az://); plain HTTP servers are read-only"
        )
    _check_json_schemas(source)
    rows = source.manifest.files()
    json = json_files(source.path, [name for name, _, _ in rows])
    todo = _to_upload(client, rows, json, report, progress)
    if todo is None:
        report.already_there = True
    else:
        _upload(client, source, todo, report, progress, on_bytes)
        sidecar = sidecar_path(source)
        if source.manifest.stats is None and sidecar.is_file():  # statistics computed later travel with it
            Client(root_url).put(f"{SIDECAR_DIR}/{md.hash}.json", sidecar.read_bytes())
        _publish_remote(client, rows, json, todo if verify else None, report, progress)
    reader.open(url)  # it opens as a cache (its JSON files checked as any reader checks them)
    return report


def _to_upload(
    client: Client, rows: list[Row], json: list[tuple[str, bytes]], report: TransferReport, progress: bool | None
) -> list[Row] | None:
    """The data files ``rows`` still to upload (counting the others in ``report`` as kept); None
    when the remote copy is complete and every object of it checks out."""
    present = client.list_objects()
    sized = [f for f in rows if present.get(f[0]) == f[1]]
    # What is there already is read back before anything is published: an object of the right
    # size may hold other bytes (a broken earlier upload, someone else's).
    report.verified_bytes = sum(n for _, n, _ in sized)
    report.recopied = [name for name, _, _ in differing(client, sized, f"check {_name(client)}", progress)]
    todo = [f for f in rows if present.get(f[0]) != f[1] or f[0] in report.recopied]
    report.kept_files = len(rows) - len(todo)
    report.kept_bytes = sum(n for _, n, _ in rows) - sum(n for _, n, _ in todo)
    if not todo and all(present.get(name) == len(data) for name, data in json) and same_json(client, json):
        return None
    if MANIFEST_FILE in present:  # republishing over a damaged or incomplete remote copy: unpublish it first
        client.delete(MANIFEST_FILE)
    return todo


def _upload(
    client: Client,
    source: reader.Shards,
    todo: list[Row],
    report: TransferReport,
    progress: bool | None,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Upload the data files ``todo``, several at once."""
    total = sum(n for _, n, _ in todo)
    md = source.metadata
    with Progress(total, f"push {md.hash[:12]}", enabled=progress) as bar:

        def tick(n: int) -> None:
            bar.update(n)
            if on_bytes is not None:
                on_bytes(n)

        report.copied_files, report.copied_bytes = len(todo), total
        with ThreadPoolExecutor(max(1, min(PUSH_FILES, len(todo)))) as pool:
            list(pool.map(lambda row: upload_file(client, source.files, row, tick), todo))


def _publish_remote(
    client: Client,
    rows: list[Row],
    json: list[tuple[str, bytes]],
    verify: list[Row] | None,
    report: TransferReport,
    progress: bool | None,
) -> None:
    """Write the JSON files, shards.json (the commit point) last, once what was uploaded checks
    out: read back (``verify``: the rows uploaded) or by the sizes the server lists."""
    *before, (commit, manifest_bytes) = json
    for name, data in before:  # metadata.json (and any other JSON file): all but the commit point
        fault_point("push-json")
        client.put(name, data)
    url = client.root
    if verify is not None:  # read back before the commit point: a copy that does not check out is never published
        report.verified_bytes += sum(n for _, n, _ in verify)
        wrong = differing(client, verify, f"verify {_name(client)}", progress)
        if wrong:
            raise ChecksumMismatchError(
                "; ".join(f"{client.url(name)}: {why}" for name, _, why in wrong[:20])
                + f": the server holds other bytes than were uploaded; {url} was not published (push again)"
            )
    else:
        check_sizes(client, rows, before)
    fault_point("push-json")
    client.put(commit, manifest_bytes)  # shards.json: the commit point
    if not same_json(client, [(commit, manifest_bytes)]):
        client.delete(commit)
        raise ChecksumMismatchError(
            f"{client.url(commit)}: the server holds other bytes than were uploaded; {url} was not published"
        )


def _name(client: Client) -> str:
    """The start of the hash of the remote cache behind ``client``, for progress bars."""
    return client.root.rsplit("/", 1)[-1][:12]


def _check_json_schemas(source: reader.Shards) -> None:
    """The local cache's stats.json and blocks.json checked against their schemas before any of
    it is uploaded (what a remote `verify` would find in the byte-identical copies)."""
    if source.manifest.stats is not None:
        source.stats  # noqa: B018 - read and checked (StatsFileError)
    if source.manifest.blocks is not None:
        for name, _, _ in source.manifest.blocked_files()[:1]:
            source.block_digests(name)  # blocks.json read and checked (ManifestError)
