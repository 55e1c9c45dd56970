"""The shard store: where caches and runs live, how a hash names a cache, and local copies.

Roots (seed 004, documented in docs/cli.md), each resolved as *argument > own variable >
shared variable*:

* shards roots: ``roots=`` > ``$SAEV_SHARDS_ROOT`` (several roots separated by ``:``,
  searched in order) > ``$SAEV_SCRATCH/saev/shards``;
* runs root: ``runs_root=`` > ``$SAEV_RUNS_ROOT`` > ``$SAEV_NFS/saev/runs``;
* stage root (local copies): ``dest=`` > ``$SAEV_STAGE_ROOT`` > ``$TMPDIR/saev/shards``
  (``tempfile.gettempdir()``, so ``/tmp`` when ``TMPDIR`` is unset).

When neither the argument nor a variable gives the shards or runs root, the functions that
need it raise `RootNotSetError` naming the variables; nothing falls back to the working
directory, so nothing is looked up or written somewhere unexpected.

>>> path = resolve("3f2a")              # doctest: +SKIP  (a unique prefix, like git)
>>> shards = stage("3f2a")              # doctest: +SKIP  (verified local copy, opened)
>>> run = create_run("3f2a", "9c1d", run_id="sae-16k")   # doctest: +SKIP
>>> run.train_shards, run.sae_checkpoint                 # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from . import reader
from .errors import (
    AmbiguousPrefixError,
    CacheRefError,
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    RootNotSetError,
    RunError,
    RunExistsError,
    RunNotFoundError,
    ShardsError,
    UnknownCacheError,
    WriterBusyError,
)
from .fileio import (
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
    write_file_atomic,
)
from .metadata import Metadata, parse_metadata
from .progress import Progress
from .protocol import is_cache_name
from .protocol.common import MANIFEST_FILE, MAX_METADATA_BYTES, METADATA_FILE, ProtocolWarning
from .protocol.jsonfile import read_json_file
from .writer import STAGING_PREFIX

PathLike = str | os.PathLike[str]
Roots = PathLike | Sequence[PathLike] | None

SHARDS_ROOT_ENV = "SAEV_SHARDS_ROOT"
RUNS_ROOT_ENV = "SAEV_RUNS_ROOT"
STAGE_ROOT_ENV = "SAEV_STAGE_ROOT"
SCRATCH_ENV = "SAEV_SCRATCH"
NFS_ENV = "SAEV_NFS"

#: Fewest hex digits accepted as a hash prefix: shorter ones match too much, as in git.
MIN_PREFIX = 4
#: Local copies in progress live here until verified and renamed (ignored by listings).
COPY_PREFIX = ".copying-"
_HEX_RE = re.compile(r"[0-9a-fA-F]+")
#: Candidates listed in an ambiguous-prefix error before "and N more".
_MAX_CANDIDATES = 20


# --------------------------------------------------------------------------------------
# roots


@dataclasses.dataclass(frozen=True)
class Root:
    """A root folder and where its value came from (``"argument"`` or a variable's name)."""

    path: Path
    source: str

    def __str__(self) -> str:
        return f"{self.path} ({self.source})"


def _env(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value or None


def shards_roots(roots: Roots = None) -> list[Root]:
    """The shards roots, searched in order: ``roots`` > ``$SAEV_SHARDS_ROOT`` > ``$SAEV_SCRATCH/saev/shards``."""
    if roots is not None:
        given = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
        if given:
            return [Root(Path(p).expanduser().absolute(), "argument") for p in given]
    env = _env(SHARDS_ROOT_ENV)
    if env is not None:
        parts = [p for p in env.split(os.pathsep) if p]
        return [Root(Path(p).expanduser().absolute(), SHARDS_ROOT_ENV) for p in parts]
    scratch = _env(SCRATCH_ENV)
    if scratch is not None:
        return [Root(Path(scratch).expanduser().absolute() / "saev" / "shards", SCRATCH_ENV)]
    raise RootNotSetError(
        f"no shards root: pass one explicitly (--root), or set {SHARDS_ROOT_ENV} "
        f"(e.g. /scratch/me/saev/shards) or {SCRATCH_ENV} (shards then live in $SAEV_SCRATCH/saev/shards)"
    )


def shards_root(root: PathLike | None = None) -> Root:
    """The first shards root: where `ls` looks by default and caches are written."""
    return shards_roots(root)[0]


def runs_root(root: PathLike | None = None) -> Root:
    """The runs root: ``root`` > ``$SAEV_RUNS_ROOT`` > ``$SAEV_NFS/saev/runs``."""
    if root is not None:
        return Root(Path(root).expanduser().absolute(), "argument")
    env = _env(RUNS_ROOT_ENV)
    if env is not None:
        return Root(Path(env).expanduser().absolute(), RUNS_ROOT_ENV)
    nfs = _env(NFS_ENV)
    if nfs is not None:
        return Root(Path(nfs).expanduser().absolute() / "saev" / "runs", NFS_ENV)
    raise RootNotSetError(
        f"no runs root: pass one explicitly (--runs-root), or set {RUNS_ROOT_ENV} "
        f"or {NFS_ENV} (runs then live in $SAEV_NFS/saev/runs)"
    )


def stage_root(root: PathLike | None = None) -> Root:
    """Where local copies go: ``root`` > ``$SAEV_STAGE_ROOT`` > ``$TMPDIR/saev/shards``."""
    if root is not None:
        return Root(Path(root).expanduser().absolute(), "argument")
    env = _env(STAGE_ROOT_ENV)
    if env is not None:
        return Root(Path(env).expanduser().absolute(), STAGE_ROOT_ENV)
    return Root(Path(tempfile.gettempdir()).absolute() / "saev" / "shards", "TMPDIR")


# --------------------------------------------------------------------------------------
# resolving a reference to one cache


def _scan(root: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(root) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def _cache_names(root: Path) -> list[str]:
    """Names of published cache directories in ``root`` (64-digit hashes, or the 8 digits of a
    cache written by saev's code; staging names excluded)."""
    return sorted(e.name for e in _scan(root) if is_cache_name(e.name) and e.is_dir())


def _kind_of_ref(key: str) -> str:
    return "hash" if len(key) == 64 else "hash prefix"


def resolve(ref: PathLike, roots: Roots = None) -> Path:
    """The absolute path of the cache ``ref`` names: an existing path, a full hash, or a
    unique hash prefix of at least 4 hex digits, looked up in the shards roots in order.

    An existing path always wins (so ``open(path)`` never changes meaning). The same hash
    in several roots is the same content; the first root's copy is returned.

    Raises `UnknownCacheError` (a `FileNotFoundError`) naming the roots searched,
    `AmbiguousPrefixError` listing the candidates, or `CacheRefError` for a short prefix.
    """
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.exists():
        return path.absolute()
    if not _HEX_RE.fullmatch(text) or len(text) > 64:
        hint = "" if os.sep in text else " (and it is not a hash or hash prefix: expected 4 to 64 hex digits)"
        raise UnknownCacheError(f"no cache at {path.absolute()}: no such file or directory{hint}")
    if len(text) < MIN_PREFIX:
        raise CacheRefError(
            f"hash prefix {text!r} is too short: expected at least {MIN_PREFIX} hex digits, found {len(text)}"
        )
    key = text.lower()
    try:
        search = shards_roots(roots)
    except RootNotSetError as err:
        # Still a "not found" error, so `open(missing_path)` raises what it always raised.
        raise UnknownCacheError(
            f"no cache at {path.absolute()}, and no shards root to look up the {_kind_of_ref(key)} {text!r} in: {err}"
        ) from None
    matches: dict[str, Path] = {}
    for root in search:
        if len(key) == 64:  # a full hash needs no listing (roots can hold thousands of caches)
            names = [key] if (root.path / key).is_dir() else []
        else:
            names = [n for n in _cache_names(root.path) if n.startswith(key)]
            if key in names:  # a whole 8-digit name (saev's code) wins over longer names it starts
                names = [key]
        for name in names:
            matches.setdefault(name, root.path / name)
    if len(matches) == 1:
        return next(iter(matches.values()))
    if not matches:
        where = ", ".join(f"{r}" + ("" if r.path.is_dir() else " [does not exist]") for r in search)
        unpublished = [
            str(r.path / e.name)
            for r in search
            for e in _scan(r.path)
            if e.name.startswith((STAGING_PREFIX, COPY_PREFIX)) and e.name.split("-", 1)[1].startswith(key)
        ]
        hint = f"; unpublished (being written, or interrupted): {', '.join(unpublished)}" if unpublished else ""
        raise UnknownCacheError(f"no cache matches {_kind_of_ref(key)} {text!r} in {where}{hint}")
    ordered = sorted(matches.items())
    lines = [f"  {name} in {path.parent}" for name, path in ordered[:_MAX_CANDIDATES]]
    if len(ordered) > _MAX_CANDIDATES:
        lines.append(f"  ... and {len(ordered) - _MAX_CANDIDATES} more")
    raise AmbiguousPrefixError(
        f"{_kind_of_ref(key)} {text!r} is ambiguous: {len(ordered)} caches match; give more digits:\n"
        + "\n".join(lines),
        [str(p) for _, p in ordered],
    )


# --------------------------------------------------------------------------------------
# listing and removing


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cache directory in a root, as `list_caches` found it (no checksums read)."""

    path: Path
    #: Parsed metadata.json when it is readable, else None.
    metadata: Metadata | None
    #: Shard files listed in the manifest, when the cache opened.
    n_shards: int | None
    #: Sum of the sizes of the regular files in the directory.
    nbytes: int
    #: `open`'s error message when the cache does not open, else None.
    problem: str | None

    @property
    def hash(self) -> str:
        return self.path.name

    @property
    def ok(self) -> bool:
        return self.problem is None


def list_caches(root: PathLike) -> list[CacheEntry]:
    """Every published cache in ``root``, sorted by hash, each opened (sizes checked, no checksums).

    Staging (``.staging-*``), partial copies (``.copying-*``) and folders not named by a
    hash are not caches and are skipped; `list_unpublished` lists the first two.
    """
    out = []
    base = Path(root).absolute()
    for name in _cache_names(base):
        path = base / name
        nbytes = sum(e.stat(follow_symlinks=False).st_size for e in _scan(path) if e.is_file(follow_symlinks=False))
        try:
            shards = open_quietly(path)  # listings show the protocol column
        except (ShardsError, OSError) as err:  # OSError: e.g. an unreadable cache among readable ones
            out.append(CacheEntry(path, _read_metadata(path), None, nbytes, str(err)))
            continue
        out.append(CacheEntry(path, shards.metadata, shards.n_shards, nbytes, None))
    return out


def list_unpublished(root: PathLike) -> list[Path]:
    """Staging directories and partial copies in ``root``: being written, or interrupted.

    Their lock files (``.staging-<hash>.lock``, beside them) are not listed."""
    base = Path(root).absolute()
    return sorted(
        base / e.name
        for e in _scan(base)
        if e.name.startswith((STAGING_PREFIX, COPY_PREFIX)) and e.is_dir(follow_symlinks=False)
    )


def _read_metadata(path: Path) -> Metadata | None:
    try:
        return parse_metadata(read_json_file(path / METADATA_FILE, MAX_METADATA_BYTES))
    except (OSError, ValueError):  # ShardsError is a ValueError
        return None


def remove(path: PathLike) -> None:
    """Delete a cache directory (or an unpublished ``.staging-``/``.copying-`` one), read-only or not.

    Refuses anything not named like a cache, so a mistyped path cannot delete other data.
    A symlink to a cache is unlinked; the cache it points to stays.
    """
    p = Path(path).expanduser().absolute()
    name = p.name
    if not (is_cache_name(name) or name.startswith((STAGING_PREFIX, COPY_PREFIX))):
        raise CacheRefError(
            f"refusing to remove {p}: expected a cache directory named by its hash (64 or 8 hex digits) "
            f"(or a {STAGING_PREFIX}/{COPY_PREFIX} directory), found the name {name!r}"
        )
    if p.is_symlink():
        p.unlink()
        return
    if not p.is_dir():
        raise UnknownCacheError(f"no cache at {p}: no such directory")
    make_writable(p)
    shutil.rmtree(p)


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


def open_quietly(path: Path, check_hash: bool = True) -> reader.Shards:
    """`open` without the protocol 2.1 warning: for copies of a source that already warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProtocolWarning)
        return reader.open(path, check_hash=check_hash)


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
    """
    source = reader.open(resolve(ref, roots))
    name = source.path.name
    base = stage_root(dest).path
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
            # A damaged local copy: move it back to the partial name and resume over it.
            make_writable(final)
            if partial.exists():
                remove(final)
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
            remove(partial)
            report.already_staged = True
            return report
        make_writable(partial)  # a copy killed between freezing and its rename is read-only
        expected = _copy_files(source, files, partial, report, progress, on_bytes, durable)
        _publish(source, partial, final, durable, expected)
    finally:
        os.close(lock_fd)
    return report


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
    with Progress(total, f"stage {source.path.name[:12]}", enabled=progress) as bar:

        def tick(n: int) -> None:
            bar.update(n)
            if on_bytes is not None:
                on_bytes(n)

        for fname, nbytes, digest in files:
            src, dst = source.path / fname, partial / fname
            if digest is None:
                report.unverified.append(fname)
                _copy_file(src, dst, nbytes, None, tick, 0, durable)
                report.copied_files += 1
                report.copied_bytes += nbytes
                continue
            before = bar.done
            if _resume_file(src, dst, nbytes, digest, report, tick, durable):
                continue
            bar.total += bar.done - before  # bytes hashed in vain are read again
            report.recopied.append(fname)
            _copy_file(src, dst, nbytes, digest, tick, 0, durable)
            report.copied_files += 1
            report.copied_bytes += nbytes
    expected = {fname: nbytes for fname, nbytes, _ in files}
    # The small JSON files go last: their presence never suggests the data is complete.
    sidecars = source.metadata.format.sidecar_names
    for fname in (METADATA_FILE, MANIFEST_FILE, *sidecars):
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
    src: Path,
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
        _copy_file(src, dst, nbytes, digest, tick, 0, durable)
        report.copied_files += 1
        report.copied_bytes += nbytes
        return True
    if have == nbytes:
        if hash_file(dst, tick)[1] == digest:
            report.kept_files += 1
            report.kept_bytes += nbytes
            return True
        return False
    if have > nbytes:
        return False
    # Half-written: hash what is there, append the rest; the whole file's digest decides.
    try:
        _copy_file(src, dst, nbytes, digest, tick, have, durable)
    except ChecksumMismatchError:
        return False
    report.resumed_files += 1
    report.kept_bytes += have
    report.copied_bytes += nbytes - have
    return True


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _copy_file(
    src: Path,
    dst: Path,
    nbytes: int,
    digest: str | None,
    tick: Callable[[int], None],
    start: int,
    durable: bool,
) -> None:
    """Copy ``src`` to ``dst`` from byte ``start`` on (earlier bytes are kept and hashed),
    checking the size and, if given, the xxh3_128 digest of the whole file."""
    h = xxhash.xxh3_128()
    buf = memoryview(bytearray(IO_CHUNK))
    note = "; what was copied is kept: free some space and stage again to resume"
    with naming_disk_full(dst, nbytes, note), open(dst, "r+b" if start else "wb", buffering=0) as out:
        if start:
            out.truncate(start)
            stream(out, None, h, tick, buf)
        with open(src, "rb", buffering=0) as inp:
            inp.seek(start)
            stream(inp, out, h, tick, buf)
        size = out.tell()
        if durable:
            os.fsync(out.fileno())
    fault_point("stage-copied")
    if size != nbytes:
        raise FileSizeError(f"{src}: expected {nbytes} bytes, found {size} (the source changed while copying?)")
    found = h.hexdigest()
    if digest is not None and found != digest:
        if start:  # the kept start of the file was bad; the caller copies it again whole
            raise ChecksumMismatchError(f"{dst}: xxh3_128 expected {digest}, found {found}")
        os.unlink(dst)
        raise ChecksumMismatchError(
            f"{src}: xxh3_128 expected {digest}, found {found} while copying it; the source cache "
            f"is damaged (check it with: saev-shards verify {src.parent})"
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
        remove(partial)  # another process published the same verified copy meanwhile


# --------------------------------------------------------------------------------------
# runs

#: The links a run folder holds (seed 004): the caches and the datasets they came from.
LINK_NAMES = ("train-shards", "train-dataset", "val-shards", "val-dataset")
#: The seed's resolution example calls the training links ``shards`` and ``dataset``.
LINK_ALIASES = {"train-shards": "shards", "train-dataset": "dataset"}
#: What training writes into ``checkpoint/``.
CHECKPOINT_FILES = ("sae.pt", "config.json")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run folder; every other path is resolved from it (seed 004, ``--run <path>``).

    >>> run = open_run("/nfs/saev/runs/sae-16k")   # doctest: +SKIP
    >>> run.train_shards                          # doctest: +SKIP
    PosixPath('/scratch/saev/shards/3f2a...')
    """

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def links_dir(self) -> Path:
        return self.path / "links"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def sae_checkpoint(self) -> Path:
        """``checkpoint/sae.pt``."""
        return self.checkpoint_dir / "sae.pt"

    @property
    def checkpoint_config(self) -> Path:
        """``checkpoint/config.json``."""
        return self.checkpoint_dir / "config.json"

    def inference_dir(self, shard_hash: str) -> Path:
        """``inference/<shard_hash>/``: outputs of running the trained SAE over a cache."""
        return self.path / "inference" / shard_hash

    def link(self, name: str) -> Path:
        """The link ``links/<name>`` itself (the seed's older alias when only that exists)."""
        if name not in LINK_NAMES:
            raise KeyError(f"unknown link {name!r}; a run has {list(LINK_NAMES)}")
        path = self.links_dir / name
        alias = LINK_ALIASES.get(name)
        if alias is not None and not os.path.lexists(path) and os.path.lexists(self.links_dir / alias):
            return self.links_dir / alias
        return path

    def target(self, name: str) -> Path:
        """Where ``links/<name>`` points, fully resolved; `RunError` if missing or dangling."""
        link = self.link(name)
        if not os.path.lexists(link):
            raise RunError(f"{link}: missing; expected a symlink (create runs with: saev-shards run init)")
        if not link.exists():
            raise RunError(f"{link}: dangling link to {os.readlink(link)} (the target does not exist)")
        return link.resolve()

    @property
    def train_shards(self) -> Path:
        return self.target("train-shards")

    @property
    def val_shards(self) -> Path:
        return self.target("val-shards")

    @property
    def train_dataset(self) -> Path:
        return self.target("train-dataset")

    @property
    def val_dataset(self) -> Path:
        return self.target("val-dataset")

    def open_train(self) -> reader.Shards:
        """Open the training cache (``links/train-shards``)."""
        return reader.open(self.train_shards)

    def open_val(self) -> reader.Shards:
        """Open the validation cache (``links/val-shards``)."""
        return reader.open(self.val_shards)


def open_run(run: PathLike, runs_root: PathLike | None = None) -> Run:
    """The run at path ``run``, or, for a bare name that is not a path, ``<runs root>/<run>``."""
    text = os.fspath(run)
    path = Path(text).expanduser()
    if path.is_dir():
        return Run(path.absolute())
    if path.exists():
        raise RunError(f"{path.absolute()}: expected a run folder, found a file")
    tried = [str(path.absolute())]
    if os.sep not in text and _RUN_ID_RE.fullmatch(text):
        with contextlib.suppress(RootNotSetError):  # a bare name that is not a path, and no root
            candidate = _runs_root_path(runs_root) / text
            if candidate.is_dir():
                return Run(candidate)
            tried.append(str(candidate))
    raise RunNotFoundError(f"no run folder at {' nor '.join(tried)}")


def _runs_root_path(root: PathLike | None) -> Path:
    # `create_run` and `open_run` take an argument named like `runs_root`; this reaches it.
    return runs_root(root).path


def create_run(
    train: PathLike,
    val: PathLike | None = None,
    *,
    run_id: str | None = None,
    runs_root: PathLike | None = None,
    roots: Roots = None,
    train_dataset: PathLike | None = None,
    val_dataset: PathLike | None = None,
) -> Run:
    """Create ``<runs root>/<run_id>/`` with ``checkpoint/`` and the ``links/`` of seed 004.

    ``train`` and ``val`` are cache references (paths, hashes or prefixes); each must open.
    The dataset links default to the ``dataset`` recorded in each cache's metadata and
    are created even when that path does not exist here (`doctor` reports them).
    ``run_id`` defaults to ``<YYYYmmdd-HHMMSS>-<train hash[:8]>``.
    """
    train_cache = reader.open(resolve(train, roots))
    val_cache = reader.open(resolve(val, roots)) if val is not None else None
    base = _runs_root_path(runs_root)
    if run_id is None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{train_cache.path.name[:8]}"
    if not _RUN_ID_RE.fullmatch(run_id):
        raise RunError(f"bad run id {run_id!r}: expected letters, digits and ._+=@- (no '/', not starting with '.')")
    targets: dict[str, Path] = {"train-shards": train_cache.path}
    dataset = train_dataset if train_dataset is not None else train_cache.metadata.dataset or None
    if dataset is not None:
        targets["train-dataset"] = Path(dataset).expanduser().absolute()
    if val_cache is not None:
        targets["val-shards"] = val_cache.path
        dataset = val_dataset if val_dataset is not None else val_cache.metadata.dataset or None
        if dataset is not None:
            targets["val-dataset"] = Path(dataset).expanduser().absolute()
    elif val_dataset is not None:
        targets["val-dataset"] = Path(val_dataset).expanduser().absolute()
    base.mkdir(parents=True, exist_ok=True)
    path = base / run_id
    try:
        os.mkdir(path)  # claims the id atomically: two creators cannot share a run
    except FileExistsError:
        raise RunExistsError(f"{path}: a run with this id already exists") from None
    (path / "links").mkdir()
    (path / "checkpoint").mkdir()
    for name, target in targets.items():
        os.symlink(target, path / "links" / name)
    return Run(path)


def _one_line(err: Exception, cache: Path) -> str:
    """An error listing several problems, on one line (a report has one line per finding),
    with the files of ``cache`` named relative to it (the line already shows where it is)."""
    text = str(err).replace(f"{cache}/", "").replace(f"{cache}: ", "")
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of a `doctor` report: ``level`` is "ok", "note", "warning" or "error"."""

    level: str
    subject: str
    message: str


LEVELS = ("ok", "note", "warning", "error")


def doctor(
    run: PathLike | Run,
    *,
    verify: bool = False,
    require_checkpoint: bool = False,
    progress: bool | None = False,
    runs_root: PathLike | None = None,
) -> list[Finding]:
    """Check a run folder: its links (missing, dangling, not symlinks, caches that do not
    open or, with ``verify``, fail their checksums), its checkpoint folder and files, and
    that the train and val caches are compatible. Errors make the run unusable.
    """
    r = run if isinstance(run, Run) else open_run(run, runs_root)
    findings: list[Finding] = []

    def add(level: str, subject: str, message: str) -> None:
        findings.append(Finding(level, subject, message))

    opened: dict[str, reader.Shards] = {}
    if not r.links_dir.is_dir():
        add("error", "links/", "missing; expected a folder of symlinks " + ", ".join(LINK_NAMES))
    else:
        for name in LINK_NAMES:
            link = r.link(name)
            subject = f"links/{link.name}"
            required = name.startswith("train-")
            if not os.path.lexists(link):
                if required:
                    add("error", subject, "missing")
                else:
                    add("note", subject, "not linked (optional)")
                continue
            if link.is_symlink() and not link.exists():
                add("error", subject, f"dangling: points to {os.readlink(link)}, which does not exist")
                continue
            shown = f"-> {os.readlink(link)}" if link.is_symlink() else "(a real folder, not a symlink)"
            if not link.is_symlink():
                add("warning", subject, "not a symlink; runs should link to the one shared copy")
            if name.endswith("-dataset"):
                if link.is_dir():
                    add("ok", subject, shown)
                else:
                    add("error", subject, f"{shown}: not a directory")
                continue
            target = link.resolve()
            try:
                cache = open_quietly(target)
            except ShardsError as err:
                add("error", subject, f"{shown}: not a valid cache: {_one_line(err, target)}")
                continue
            opened[name] = cache
            if verify:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        nbytes = cache.verify(progress=progress)
                except ShardsError as err:
                    add("error", subject, f"{shown}: verification failed: {_one_line(err, target)}")
                    continue
                verified = f", {nbytes:,} bytes verified"
            else:
                verified = ""
            md = cache.metadata
            add("ok", subject, f"{shown} ({md.n_examples:,} examples, {md.dtype}, layers {list(md.layers)}{verified})")
        checked = {r.link(name).name for name in LINK_NAMES}
        for e in sorted(_scan(r.links_dir), key=lambda e: e.name):
            p = Path(e.path)
            if e.name in checked:
                continue
            if p.is_symlink() and not p.exists():
                add("error", f"links/{e.name}", f"dangling: points to {os.readlink(p)}, which does not exist")
    if not r.checkpoint_dir.is_dir():
        add("error", "checkpoint/", "missing; expected the folder training writes into")
    else:
        for fname in CHECKPOINT_FILES:
            p = r.checkpoint_dir / fname
            subject = f"checkpoint/{fname}"
            if not p.exists():
                if p.is_symlink():
                    add("error", subject, f"dangling: points to {os.readlink(p)}, which does not exist")
                elif require_checkpoint:
                    add("error", subject, "missing")
                else:
                    add("note", subject, "not written yet (the run has not been trained)")
            elif not p.is_file():
                add("error", subject, "not a regular file")
            elif p.stat().st_size == 0:
                add("error", subject, "empty file")
            else:
                add("ok", subject, f"{p.stat().st_size:,} bytes")
    train, val = opened.get("train-shards"), opened.get("val-shards")
    if train is not None and val is not None:
        if train.path.name == val.path.name:
            add("warning", "links/val-shards", "the same cache as train-shards")
        else:
            a, b = train.metadata, val.metadata
            differ = [
                f"{k} {getattr(a, k)!r} vs {getattr(b, k)!r}"
                for k in ("family", "ckpt", "layers", "d_model", "tokens_per_ex", "dtype")
                if getattr(a, k) != getattr(b, k)
            ]
            if differ:
                add("warning", "links/val-shards", "train and val caches differ: " + "; ".join(differ))
    return findings
