"""Roots and resolution: where caches and runs live, and which cache a path, hash or prefix names.

Roots (saev's storage layout, documented in docs/store.md), each resolved as *argument > own variable >
shared variable*:

* shards roots: ``roots=`` > ``$SAEV_SHARDS_ROOT`` (several roots separated by ``:``,
  searched in order) > ``$SAEV_SCRATCH/saev/shards``;
* runs root: ``runs_root=`` > ``$SAEV_RUNS_ROOT`` > ``$SAEV_NFS/saev/runs``;
* stage root (local copies): ``dest=`` > ``$SAEV_STAGE_ROOT`` > ``$TMPDIR/saev/shards``
  (``tempfile.gettempdir()``, so ``/tmp`` when ``TMPDIR`` is unset).

When neither the argument nor a variable gives the shards or runs root, the functions that
need it raise `RootNotSetError` naming the variables; nothing falls back to the working
directory, so nothing is looked up or written somewhere unexpected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import (
    AmbiguousPrefixError,
    CacheRefError,
    RootNotSetError,
    UnknownCacheError,
)
from ..protocol import is_cache_name
from ..protocol.jsonfile import short_repr
from ..protocol.staging import STAGING_PREFIX
from ..storage.url import is_url, split_roots

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
#: The scratch folder of a shuffle (buckets and runs) until it publishes, and the lock a
#: running shuffle holds inside it (`saev_shards.shuffle`; `clean` judges liveness by it).
SHUFFLE_PREFIX = ".shuffle-"
SHUFFLE_LOCK_FILE = ".lock"
#: Prefix of the folder where the ranks of a multi-process shuffle meet without a process
#: group (`saev_shards.shuffle.meeting`): rank records only, nothing a rerun resumes.
SHUFFLE_RANKS_PREFIX = f"{SHUFFLE_PREFIX}ranks-"
_HEX_RE = re.compile(r"[0-9a-fA-F]+")
#: Candidates listed in an ambiguous-prefix error before "and N more".
_MAX_CANDIDATES = 20
#: Caches suggested for a prefix that matches none.
_MAX_SUGGESTIONS = 5


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


def _given(roots: Roots) -> list[PathLike]:
    if roots is None:
        return []
    return [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)


def remote_roots(roots: Roots = None) -> list[str]:
    """The remote shards roots (URLs such as ``s3://bucket/shards``) among ``roots``, else among
    ``$SAEV_SHARDS_ROOT``; searched after the local ones (`store.remote_roots.find_cache`)."""
    given = _given(roots)
    if given:
        return [str(p) for p in given if is_url(p)]
    return [p for p in split_roots(_env(SHARDS_ROOT_ENV) or "") if is_url(p)]


def local_roots(roots: Roots = None) -> list[PathLike] | None:
    """``roots`` without its URLs (None when nothing local remains: the defaults apply)."""
    local = [p for p in _given(roots) if not is_url(p)]
    return local or None


def shards_roots(roots: Roots = None) -> list[Root]:
    """The local shards roots, searched in order: ``roots`` > ``$SAEV_SHARDS_ROOT`` >
    ``$SAEV_SCRATCH/saev/shards``. URLs among them are remote roots (`remote_roots`)."""
    given = [p for p in _given(roots) if not is_url(p)]
    if given:
        return [Root(Path(p).expanduser().absolute(), "argument") for p in given]
    env = _env(SHARDS_ROOT_ENV)
    parts = [p for p in split_roots(env or "") if not is_url(p)]
    if parts:
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


def _closest(key: str, search: Sequence[Root]) -> str:
    """The caches that do exist, closest to a mistyped ``key`` first (longest common prefix,
    then fewest differing digits over the typed length): a typo is usually one digit."""
    names = sorted({n for r in search for n in _cache_names(r.path)})
    if not names:
        return "; the roots hold no caches"

    def distance(name: str) -> tuple[int, int, str]:
        differ = [a != b for a, b in zip(key, name, strict=False)]
        common = differ.index(True) if True in differ else len(differ)
        return -common, sum(differ), name

    shown = sorted(names, key=distance)[:_MAX_SUGGESTIONS]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return f"; caches there, closest first: {', '.join(n[:12] for n in shown)}{more} (`saev-shards ls` lists them)"


#: Longest reference accepted, in bytes: what Linux lets a path hold (PATH_MAX), and a name (NAME_MAX).
MAX_REF_BYTES = 4096
MAX_NAME_BYTES = 255


def check_reference(ref: PathLike, what: str = "cache reference") -> None:
    """Refuse a reference that no path can be: empty (or only spaces), holding a NUL byte,
    longer than `MAX_REF_BYTES` or with a name longer than `MAX_NAME_BYTES` (the system would
    answer with a raw ``ValueError`` or ``OSError``); `CacheRefError` saying which, the
    reference quoted to a bounded length."""
    text = os.fspath(ref)
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)
    shown = short_repr(text, 60)
    if not raw.strip():
        raise CacheRefError(f"{what} {shown}: expected a path, a hash or a hash prefix, found an empty reference")
    if b"\0" in raw:
        raise CacheRefError(f"{what} {shown}: holds a NUL character, which no path can")
    if len(raw) > MAX_REF_BYTES:
        raise CacheRefError(f"{what} {shown}: {len(raw):,} bytes long, more than a path may be ({MAX_REF_BYTES:,})")
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > MAX_NAME_BYTES:
        raise CacheRefError(
            f"{what} {shown}: holds a name of {longest:,} bytes, more than a file name may be ({MAX_NAME_BYTES})"
        )


def resolve(ref: PathLike, roots: Roots = None) -> Path:
    """The absolute path of the cache ``ref`` names: an existing path, a full hash, or a
    unique hash prefix of at least 4 hex digits, looked up in the shards roots in order.

    An existing path always wins (so ``open(path)`` never changes meaning); spaces around a
    hash are dropped. A prefix that matches nothing lists the caches that exist, closest
    first. The same hash
    in several roots is the same content; the first root's copy is returned.

    Raises `UnknownCacheError` (a `FileNotFoundError`) naming the roots searched,
    `AmbiguousPrefixError` listing the candidates, or `CacheRefError` for a short prefix.
    """
    check_reference(ref)
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.exists():
        return path.absolute()
    if text != text.strip():  # "3f2a " pasted from a listing: the spaces are not part of a hash
        text = text.strip()
        path = Path(text).expanduser()
        if path.exists():
            return path.absolute()
    if not _HEX_RE.fullmatch(text) or len(text) > 64:
        hint = "" if os.sep in text else " (and it is not a hash or hash prefix: expected 4 to 64 hex digits)"
        if os.sep not in text:  # a mistyped prefix ("3f2g"): show what there is
            with contextlib.suppress(RootNotSetError):
                suggestions = _closest(text.lower(), shards_roots(roots))
                hint += suggestions.replace("caches there", "caches in the shards roots")
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
        suggestions = _closest(key, search)
        raise UnknownCacheError(f"no cache matches {_kind_of_ref(key)} {text!r} in {where}{hint}{suggestions}")
    ordered = sorted(matches.items())
    lines = [f"  {name} in {path.parent}" for name, path in ordered[:_MAX_CANDIDATES]]
    if len(ordered) > _MAX_CANDIDATES:
        lines.append(f"  ... and {len(ordered) - _MAX_CANDIDATES} more")
    raise AmbiguousPrefixError(
        f"{_kind_of_ref(key)} {text!r} is ambiguous: {len(ordered)} caches match; give more digits:\n"
        + "\n".join(lines),
        [str(p) for _, p in ordered],
    )
