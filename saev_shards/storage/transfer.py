"""Moving a cache's files between storages: every byte hashed on its way, checked against the
manifest before anything is published, and resumable. The one routine behind `store.stage`
and `store.pull` (any `Files` into a local folder: `copy_file`, `resume_file`) and
`store.push` (a local cache into an object store: `upload_file`, `differing`).

Every stream of a file's bytes goes through `StreamDigest`: each piece hashed by one
`fileio.BlockHasher`, counted and ticked before it is handed on, and `mismatch` says, in one
wording, how what passed differs from the manifest's size and xxh3_128 digest. The storages'
own whole-file reads (`verify_file`, a remote whole-file unit) use it too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import ChecksumMismatchError, FileSizeError, RemoteBucketError, ShardsError
from ..fileio import BlockHasher, fault_point, naming_disk_full, write_all
from ..progress import Progress
from ..protocol.common import MANIFEST_FILE, METADATA_FILE
from .base import Files
from .client import PART_BYTES, Client, requests_in_flight
from .local import LocalFiles

#: ``(name, bytes, xxh3_128 or None)``: a data file as its manifest lists it (`Manifest.files`).
Row = tuple[str, int, str | None]
#: Files uploaded at once by a push (each with its parts in flight).
PUSH_FILES = 4


@dataclasses.dataclass
class TransferReport:
    """What a transfer did: `store.stage` / `copy_cache` / `pull` (a verified local copy) or
    `store.push` (a verified remote copy). ``StageReport`` and ``PushReport`` are its earlier
    names, and `path`, `url`, `uploaded_files`, `replaced`, `already_staged`... its earlier
    spellings of the same fields."""

    #: The cache copied: its folder (of a remote source, where its JSON files are kept).
    source: Path
    #: The published copy: a local folder (stage, pull) or a URL (push).
    dest: Path | str
    copied_files: int = 0
    copied_bytes: int = 0
    #: Files an interrupted transfer left complete, checked again and kept.
    kept_files: int = 0
    #: Bytes found already there and kept (whole files, and the verified start of resumed ones).
    kept_bytes: int = 0
    #: Files an interrupted copy left half-written, completed from where they stopped.
    resumed_files: int = 0
    #: Files found at the destination that failed verification and were transferred again
    #: (a damaged earlier copy, an object with other bytes).
    recopied: list[str] = dataclasses.field(default_factory=list)
    #: Files with no recorded checksum (protocol 2.1 without checksums.json): sizes only.
    unverified: list[str] = dataclasses.field(default_factory=list)
    #: A complete copy was already there (checked); nothing was transferred.
    already_there: bool = False
    #: A published local copy was damaged (e.g. files purged) and has been repaired.
    repaired: bool = False
    #: Bytes read back from the server and checked against the manifest (push: what was
    #: there already, always; what was uploaded, unless ``verify=False``).
    verified_bytes: int = 0
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

    @property
    def path(self) -> Path:
        """The local copy (stage, pull)."""
        return Path(self.dest)

    @property
    def url(self) -> str:
        """The remote copy: ``<root URL>/<HASH>`` (push)."""
        return str(self.dest)

    @property
    def already_staged(self) -> bool:
        return self.already_there

    @property
    def already_pushed(self) -> bool:
        return self.already_there

    @property
    def uploaded_files(self) -> int:
        return self.copied_files

    @property
    def uploaded_bytes(self) -> int:
        return self.copied_bytes

    @property
    def replaced(self) -> list[str]:
        return self.recopied


class StreamDigest:
    """The bytes of one file on their way somewhere (module docstring): ``through(pieces)``
    hands each piece on after hashing and counting it; `drain` only hashes. Several streams
    may pass in turn (the kept start of a file, then the rest)."""

    def __init__(self, tick: Callable[[int], None] | None = None, block_size: int | None = None) -> None:
        self.hasher = BlockHasher(block_size)
        self.nbytes = 0
        self.tick = tick

    def through(self, pieces: Iterable[Any]) -> Iterator[memoryview]:
        """Each piece hashed, handed on, and ticked once the taker is done with it (a progress
        bar, or a hook that interrupts, counts what was written, not what was about to be)."""
        for piece in pieces:
            view = memoryview(piece)
            self.hasher.update(view)
            self.nbytes += view.nbytes
            yield view
            if self.tick is not None:
                self.tick(view.nbytes)

    def drain(self, pieces: Iterable[Any]) -> StreamDigest:
        for _ in self.through(pieces):
            pass
        return self

    @property
    def digest(self) -> str:
        return self.hasher.hexdigest()

    def block_digests(self) -> list[str]:
        return self.hasher.block_hexdigests()

    def mismatch(self, nbytes: int, digest: str | None) -> str | None:
        """How what passed differs from ``nbytes`` bytes of xxh3_128 ``digest`` (None: unknown,
        the size alone decides); None when it matches. Streams stop one byte past the size they
        were asked for, so a longer file is "more"."""
        if self.nbytes != nbytes:
            return f"expected {nbytes} bytes, found {'more' if self.nbytes > nbytes else self.nbytes}"
        if digest is not None and self.digest != digest:
            return f"xxh3_128 expected {digest}, found {self.digest}"
        return None


# -- into a local folder: stage and pull --------------------------------------------------------


def copy_file(
    files: Files, row: Row, dst: Path, tick: Callable[[int], None], *, start: int = 0, durable: bool = True
) -> None:
    """Copy data file ``row`` of ``files`` to ``dst`` from byte ``start`` on (the bytes before are
    kept and hashed), checking the size and, if the row has one, the xxh3_128 digest of the
    whole file. A damaged source (copied whole) raises `ChecksumMismatchError` naming it, and
    ``dst`` is removed; a kept start that does not add up raises it naming ``dst``."""
    name, nbytes, digest = row
    src = files.where(name)
    note = "; what was copied is kept: free some space and stage again to resume"
    seen = StreamDigest(tick)
    with naming_disk_full(dst, nbytes, note), open(dst, "r+b" if start else "wb", buffering=0) as out:
        if start:
            out.truncate(start)
            seen.drain(LocalFiles(dst.parent).stream(dst.name, 0, start))
            out.seek(start)
        for view in seen.through(files.stream(name, start, nbytes)):
            write_all(out, view)
        if durable:
            os.fsync(out.fileno())
    fault_point("stage-copied")
    if seen.nbytes != nbytes:
        raise FileSizeError(f"{src}: {seen.mismatch(nbytes, None)}: the source does not hold what its manifest says")
    problem = seen.mismatch(nbytes, digest)
    if problem is None:
        return
    if start:  # the kept start of the file was bad; the caller copies it again whole
        raise ChecksumMismatchError(f"{dst}: {problem}")
    os.unlink(dst)
    raise ChecksumMismatchError(
        f"{src}: {problem} while copying it; the source cache is damaged (check it with: saev-shards verify "
        f"{files.location})"
    )


def resume_file(
    files: Files, row: Row, dst: Path, report: TransferReport, tick: Callable[[int], None], durable: bool
) -> bool:
    """Copy data file ``row`` to ``dst``, using what an interrupted copy left there; True when
    ``dst`` now verifies (counted in ``report``), False when what is there has to go (the
    caller copies the file again whole)."""
    _, nbytes, digest = row
    have = size_of(dst)
    if have < 0:
        copy_file(files, row, dst, tick, durable=durable)
        report.add(copied=nbytes)
        return True
    if have == nbytes:
        if StreamDigest(tick).drain(LocalFiles(dst.parent).stream(dst.name)).digest == digest:
            report.add(kept=nbytes)
            return True
        return False
    if have > nbytes:
        return False
    # Half-written: hash what is there, append the rest; the whole file's digest decides.
    try:
        copy_file(files, row, dst, tick, start=have, durable=durable)
    except ChecksumMismatchError:
        return False
    report.add(resumed=have, copied=nbytes - have)
    return True


def size_of(path: Path) -> int:
    """The size of ``path``, -1 when there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


# -- into an object store: push ----------------------------------------------------------------


def upload_file(client: Client, files: Files, row: Row, tick: Callable[[int], None]) -> None:
    """Upload data file ``row`` of ``files`` (a local cache) under ``client``'s root (multipart,
    parts in parallel), hashing what is read: the object is deleted again when the bytes do not
    match the manifest, and `ChecksumMismatchError` names the local file."""
    name, nbytes, digest = row
    seen = StreamDigest(tick)
    pieces = (bytes(view) for view in seen.through(files.stream(name, 0, nbytes)))  # each piece its own
    client.put(name, b"".join(pieces) if nbytes <= PART_BYTES else pieces)
    fault_point("pushed-file")
    problem = seen.mismatch(nbytes, digest)
    if problem is not None:
        client.delete(name)
        raise ChecksumMismatchError(
            f"{files.where(name)}: {problem} while uploading it; the local cache is damaged and was not published "
            f"(check it with: saev-shards verify {files.location})"
        )


def differing(client: Client, rows: list[Row], desc: str, progress: bool | None) -> list[tuple[str, int, str]]:
    """``(name, nbytes, what differs)`` of each of ``rows`` whose object on the server is not
    exactly its ``nbytes`` bytes with its xxh3_128 (read back, several at once, never more
    than one byte past its size)."""
    if not rows:
        return []
    with Progress(sum(n for _, n, _ in rows), desc, enabled=progress) as bar:
        lock = threading.Lock()

        def tick(n: int) -> None:
            with lock:
                bar.update(n)

        def one(row: Row) -> tuple[str, int, str] | None:
            name, nbytes, digest = row
            try:
                problem = StreamDigest(tick).drain(client.stream(name, 0, nbytes, PART_BYTES)).mismatch(nbytes, digest)
            except RemoteBucketError:
                raise
            except FileNotFoundError:
                problem = "missing"
            return None if problem is None else (name, nbytes, problem)

        with ThreadPoolExecutor(max(1, min(requests_in_flight(), len(rows))), "saev-push-check") as pool:
            return [found for found in pool.map(one, rows) if found is not None]


def json_files(folder: Path, listed: Iterable[str]) -> list[tuple[str, bytes]]:
    """The JSON files of the cache in ``folder`` in upload order: those beside the manifest
    that it does not list (``listed``: blocks.json, protocol 3.1), metadata.json, shards.json last."""
    names = [n for n in sorted(os.listdir(folder)) if n.endswith(".json") and n not in (METADATA_FILE, MANIFEST_FILE)]
    data_files = set(listed)
    extra = [n for n in names if n not in data_files]
    return [(n, (folder / n).read_bytes()) for n in [*extra, METADATA_FILE, MANIFEST_FILE]]


def same_json(client: Client, files: list[tuple[str, bytes]]) -> bool:
    """Whether the server holds exactly these JSON files."""
    try:
        return all(client.get_bytes(name, len(data)) == data for name, data in files)
    except (FileNotFoundError, ShardsError):
        return False


def check_sizes(client: Client, rows: list[Row], json: list[tuple[str, bytes]]) -> None:
    """`FileSizeError` naming every object whose listed size is not what was uploaded."""
    listed = client.list_objects()
    wrong = [
        f"{client.url(name)}: expected {nbytes} bytes, found {listed.get(name, 'none')}"
        for name, nbytes in [*((n, s) for n, s, _ in rows), *((n, len(d)) for n, d in json)]
        if listed.get(name) != nbytes
    ]
    if wrong:
        raise FileSizeError("; ".join(wrong[:20]) + f"; {client.root} was not published (push again)")
