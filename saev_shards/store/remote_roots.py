"""Shards roots in object stores: `push` a cache to one, list and resolve what it holds.

A remote shards root (``s3://bucket/prefix``, protocol.md 6.1) is laid out as a local one:
``<root>/<HASH>/<files>`` and ``<root>/.stats/<HASH>.json``. A cache there is published when
its shards.json exists: `push` uploads the data files first (several at once, each a
multipart upload with parts in parallel, hashed while read so that damaged local bytes are
never published), then blocks.json and the statistics sidecar, then metadata.json, and
shards.json last. A killed push leaves objects without shards.json, which no listing or
reader takes for a cache, and running it again uploads only what is missing. `pull` is
`stage` from a remote source (`staging.copy_cache`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from .. import reader
from ..errors import (
    AmbiguousPrefixError,
    CacheRefError,
    ChecksumMismatchError,
    FileSizeError,
    ManifestError,
    RemoteBucketError,
    RemoteError,
    ShardsError,
    UnknownCacheError,
)
from ..fileio import fault_point
from ..metadata import Metadata
from ..progress import Progress
from ..protocol import is_cache_name
from ..protocol.common import MANIFEST_FILE, METADATA_FILE
from ..reader.sidecars import SIDECAR_DIR, sidecar_path
from ..remote.client import PART_BYTES, Client, requests_in_flight
from ..remote.url import is_url, join_url, split_url, strip
from .roots import MIN_PREFIX, PathLike, Roots, local_roots, remote_roots, resolve

#: Files uploaded at once by `push` (each with its parts in flight).
PUSH_FILES = 4
_HEX_RE = re.compile(r"[0-9a-f]{1,64}")


@dataclasses.dataclass
class PushReport:
    """What `push` did."""

    source: Path
    #: The URL of the remote cache: ``<root URL>/<HASH>``.
    url: str
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    #: Data files already there (an earlier, interrupted push) with the right size and digest.
    kept_files: int = 0
    kept_bytes: int = 0
    #: Objects found with the right size but other bytes (a broken earlier upload, someone
    #: else's): uploaded again, before the cache was published.
    replaced: list[str] = dataclasses.field(default_factory=list)
    #: The remote cache was already complete and every object of it checked; nothing was uploaded.
    already_pushed: bool = False
    #: Bytes read back from the server and checked against the manifest (what was there
    #: already, always; what was uploaded, unless ``verify=False``).
    verified_bytes: int = 0


def push(
    ref: PathLike,
    root_url: str,
    *,
    roots: Roots = None,
    verify: bool = True,
    progress: bool | None = False,
    on_bytes: Callable[[int], None] | None = None,
) -> PushReport:
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
    if md.format.legacy:
        raise ManifestError(
            f"{source.path}: a protocol {md.protocol} cache ({md.format.summary}): remote caches are protocol 3 "
            f"only; convert it first (`saev-shards convert {source.path} --to 3.0`)"
        )
    url = join_url(root_url, md.hash)
    report = PushReport(source=source.path, url=url)
    client = Client(url)
    if not client.can_list:
        raise RemoteError(
            f"{root_url}: push needs an object store (s3://, gs://, az://); plain HTTP servers are read-only"
        )
    _check_json_schemas(source)
    present = client.list_objects()
    data_files = source.manifest.files()
    json_files = _json_files(source)
    sized = [f for f in data_files if present.get(f[0]) == f[1]]
    # What is there already is read back before anything is published: an object of the right
    # size may hold other bytes (a broken earlier upload, someone else's).
    report.verified_bytes = sum(n for _, n, _ in sized)
    damaged = _differing(client, sized, f"check {md.hash[:12]}", progress)
    report.replaced = [name for name, _, _ in damaged]
    todo = [f for f in data_files if present.get(f[0]) != f[1] or f[0] in report.replaced]
    report.kept_files = len(data_files) - len(todo)
    report.kept_bytes = sum(n for _, n, _ in data_files) - sum(n for _, n, _ in todo)
    if not todo and all(present.get(name) == len(data) for name, data in json_files) and _same_json(client, json_files):
        report.already_pushed = True
        reader.open(url)  # it opens as a cache (its JSON files checked as any reader checks them)
        return report
    if MANIFEST_FILE in present:  # republishing over a damaged or incomplete remote copy: unpublish it first
        client.delete(MANIFEST_FILE)
    total = sum(n for _, n, _ in todo)
    with Progress(total, f"push {md.hash[:12]}", enabled=progress) as bar:

        def tick(n: int) -> None:
            bar.update(n)
            if on_bytes is not None:
                on_bytes(n)

        report.uploaded_files, report.uploaded_bytes = len(todo), total
        with ThreadPoolExecutor(max(1, min(PUSH_FILES, len(todo)))) as pool:
            list(pool.map(lambda f: _upload_file(client, source.path / f[0], f[0], f[1], f[2], tick), todo))
    sidecar = sidecar_path(source)
    if source.manifest.stats is None and sidecar.is_file():  # statistics computed later travel with it
        Client(root_url).put(f"{SIDECAR_DIR}/{md.hash}.json", sidecar.read_bytes())
    *before, (commit, manifest_bytes) = json_files
    for name, data in before:  # metadata.json (and any other JSON file): all but the commit point
        fault_point("push-json")
        client.put(name, data)
    if verify:  # read back before the commit point: a copy that does not check out is never published
        report.verified_bytes += total
        wrong = _differing(client, todo, f"verify {md.hash[:12]}", progress)
        if wrong:
            raise ChecksumMismatchError(
                "; ".join(f"{client.url(name)}: {why}" for name, _, why in wrong[:20])
                + f": the server holds other bytes than were uploaded; {url} was not published (push again)"
            )
    else:
        _check_sizes(client, data_files, before)
    fault_point("push-json")
    client.put(commit, manifest_bytes)  # shards.json: the commit point
    if not _same_json(client, [(commit, manifest_bytes)]):
        client.delete(commit)
        raise ChecksumMismatchError(
            f"{client.url(commit)}: the server holds other bytes than were uploaded; {url} was not published"
        )
    reader.open(url)  # it opens as a cache (its JSON files checked as any reader checks them)
    return report


def _check_json_schemas(source: reader.Shards) -> None:
    """The local cache's stats.json and blocks.json checked against their schemas before any of
    it is uploaded (what a remote `verify` would find in the byte-identical copies)."""
    if source.manifest.stats is not None:
        source.stats  # noqa: B018 - read and checked (StatsFileError)
    if source.manifest.blocks is not None:
        for name, _, _ in source.manifest.blocked_files()[:1]:
            source.block_digests(name)  # blocks.json read and checked (ManifestError)


def _differing(
    client: Client, files: list[tuple[str, int, str | None]], desc: str, progress: bool | None
) -> list[tuple[str, int, str]]:
    """``(name, nbytes, what differs)`` of each of ``files`` whose object on the server is not
    exactly its ``nbytes`` bytes with its xxh3_128 (read back, several at once, never more
    than one byte past its size)."""
    if not files:
        return []
    with Progress(sum(n for _, n, _ in files), desc, enabled=progress) as bar:
        lock = threading.Lock()

        def one(row: tuple[str, int, str | None]) -> tuple[str, int, str] | None:
            name, nbytes, digest = row
            h = xxhash.xxh3_128()
            got = 0
            try:
                for piece in client.stream(name, 0, nbytes, PART_BYTES):
                    view = memoryview(piece)
                    h.update(view)
                    got += view.nbytes
                    with lock:
                        bar.update(view.nbytes)
            except RemoteBucketError:
                raise
            except FileNotFoundError:
                return name, nbytes, "missing"
            if got != nbytes:
                return name, nbytes, f"expected {nbytes} bytes, found {'more' if got > nbytes else got}"
            if digest is not None and h.hexdigest() != digest:
                return name, nbytes, f"xxh3_128 expected {digest}, found {h.hexdigest()}"
            return None

        with ThreadPoolExecutor(max(1, min(requests_in_flight(), len(files))), "saev-push-check") as pool:
            return [found for found in pool.map(one, files) if found is not None]


def _json_files(source: reader.Shards) -> list[tuple[str, bytes]]:
    """The JSON files of ``source`` in upload order: those beside the manifest, metadata.json,
    shards.json last."""
    names = [
        n for n in sorted(os.listdir(source.path)) if n.endswith(".json") and n not in (METADATA_FILE, MANIFEST_FILE)
    ]
    listed = {name for name, _, _ in source.manifest.files()}
    extra = [n for n in names if n not in listed]  # blocks.json (protocol 3.1)
    return [(n, (source.path / n).read_bytes()) for n in [*extra, METADATA_FILE, MANIFEST_FILE]]


def _same_json(client: Client, json_files: list[tuple[str, bytes]]) -> bool:
    try:
        return all(client.get_bytes(name, len(data)) == data for name, data in json_files)
    except (FileNotFoundError, ShardsError):
        return False


def _upload_file(
    client: Client, path: Path, name: str, nbytes: int, digest: str | None, tick: Callable[[int], None]
) -> None:
    """Upload ``path`` as ``name`` (multipart, parts in parallel), hashing what is read: the
    object is deleted again when the local bytes do not match the manifest."""
    h = xxhash.xxh3_128()
    read = [0]

    def pieces() -> Iterator[bytes]:
        with open(path, "rb", buffering=0) as f:
            while True:
                chunk = f.read(PART_BYTES)
                if not chunk:
                    return
                h.update(chunk)
                read[0] += len(chunk)
                tick(len(chunk))
                yield chunk

    if nbytes <= PART_BYTES:
        client.put(name, b"".join(pieces()))
    else:
        client.put(name, pieces())
    fault_point("pushed-file")
    if read[0] != nbytes or (digest is not None and h.hexdigest() != digest):
        client.delete(name)
        found = f"{read[0]} bytes" if read[0] != nbytes else f"xxh3_128 {h.hexdigest()}"
        raise ChecksumMismatchError(
            f"{path}: expected {nbytes} bytes with xxh3_128 {digest}, found {found} while uploading it; the local "
            f"cache is damaged and was not published (check it with: saev-shards verify {path.parent})"
        )


def _check_sizes(
    client: Client, data_files: list[tuple[str, int, str | None]], json_files: list[tuple[str, bytes]]
) -> None:
    listed = client.list_objects()
    wrong = [
        f"{client.url(name)}: expected {nbytes} bytes, found {listed.get(name, 'none')}"
        for name, nbytes in [*((n, s) for n, s, _ in data_files), *((n, len(d)) for n, d in json_files)]
        if listed.get(name) != nbytes
    ]
    if wrong:
        raise FileSizeError("; ".join(wrong[:20]) + f"; {client.root} was not published (push again)")


# --------------------------------------------------------------------------------------
# listing and resolving


@dataclasses.dataclass(frozen=True)
class RemoteEntry:
    """One cache folder in a remote root, as `list_remote` found it."""

    url: str
    #: Bytes of its objects.
    nbytes: int
    #: Its shards.json is there (else: an upload in progress, or interrupted).
    published: bool
    metadata: Metadata | None = None
    n_shards: int | None = None
    #: `open`'s error message when the published cache does not open, else None.
    problem: str | None = None

    @property
    def hash(self) -> str:
        return split_url(self.url)[1]

    @property
    def ok(self) -> bool:
        return self.published and self.problem is None


def list_remote(root_url: str, *, open_caches: bool = True) -> list[RemoteEntry]:
    """The cache folders of the remote root ``root_url`` (one listing), each published one opened
    (its JSON files read) unless ``open_caches`` is false."""
    client = Client(root_url)
    if not client.can_list:
        raise RemoteError(f"{root_url}: a plain HTTP server cannot list its files: name a cache by its full URL")
    sizes: dict[str, int] = {}
    published: set[str] = set()
    for key, size in client.list_objects().items():
        head, _, rest = key.partition("/")
        if not is_cache_name(head) or not rest:
            continue
        sizes[head] = sizes.get(head, 0) + size
        if rest == MANIFEST_FILE:
            published.add(head)
    out = []
    for name in sorted(sizes):
        url = join_url(root_url, name)
        entry = RemoteEntry(url, sizes[name], name in published)
        if entry.published and open_caches:
            try:
                shards = reader.open(url)
                entry = dataclasses.replace(entry, metadata=shards.metadata, n_shards=shards.n_shards)
            except (ShardsError, OSError) as err:
                entry = dataclasses.replace(entry, problem=str(err))
        out.append(entry)
    return out


def remote_objects(url: str) -> dict[str, int]:
    """The objects of the remote cache ``url`` (``<root>/<HASH>``): names under the root
    (``<HASH>/<file>``, and its statistics sidecar ``.stats/<HASH>.json`` when there is one)
    -> sizes. `UnknownCacheError` when there is none."""
    root, name = split_url(url)
    client = Client(root)
    objects = client.list_objects(f"{name}/")
    if not objects:
        raise UnknownCacheError(f"no cache at {url}: no objects under it")
    sidecar = f"{SIDECAR_DIR}/{name}.json"
    size = client.head(sidecar)
    if size is not None:
        objects[sidecar] = size
    return objects


def remove_remote(url: str) -> int:
    """Delete the remote cache ``url`` (``<root>/<HASH>``) and its statistics sidecar; the bytes deleted.

    shards.json goes first: from then on no listing or reader takes the rest for a cache
    (protocol.md 6.1), so a reader opening it meets "no cache", never half a cache. A delete
    killed part-way leaves an unpublished folder, which running it again removes. Readers on
    other machines are not seen: one that has the cache open fails at its next uncached read.
    """
    root, name = split_url(url)
    client = Client(root)
    objects = remote_objects(url)
    manifest = f"{name}/{MANIFEST_FILE}"
    if manifest in objects:
        client.delete(manifest)
    rest = [key for key in objects if key != manifest]
    with ThreadPoolExecutor(PUSH_FILES) as pool:
        list(pool.map(client.delete, rest))
    return sum(objects.values())


def nested_roots(root_url: str, limit: int = 5) -> list[str]:
    """Up to ``limit`` shards roots found below ``root_url`` (folders holding published caches,
    ``<root_url>/<prefix>/<HASH>/shards.json``): what ``ls`` suggests when a bucket's top
    holds no cache itself. One listing of everything under ``root_url``."""
    client = Client(root_url)
    if not client.can_list:
        return []
    found: set[str] = set()
    for key in client.list_objects():
        parts = key.split("/")
        if len(parts) >= 3 and parts[-1] == MANIFEST_FILE and is_cache_name(parts[-2]):
            found.add(join_url(root_url, "/".join(parts[:-2])))
    return sorted(found)[:limit]


def resolve_remote(ref: str) -> str:
    """The URL of the remote cache ``ref`` names: ``<root>/<full hash>`` as given, or
    ``<root>/<unique hash prefix>`` looked up in the root (object stores only: a plain HTTP
    server cannot list, so a cache there is named by its full hash)."""
    url = strip(ref)
    root, last = split_url(url)
    key = last.lower()
    if not _HEX_RE.fullmatch(key) or len(key) == 64:
        return url
    if len(key) < MIN_PREFIX:
        raise CacheRefError(
            f"hash prefix {last!r} is too short: expected at least {MIN_PREFIX} hex digits, found {len(key)}"
        )
    if not Client(root).can_list:
        return url
    matches = _matches(root, key)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UnknownCacheError(f"no cache matches hash prefix {last!r} in {root}")
    raise _ambiguous(last, matches)


def _matches(root: str, key: str) -> list[str]:
    """URLs of the published caches of ``root`` named ``key`` or, failing that, starting with it."""
    names = [e.hash for e in list_remote(root, open_caches=False) if e.published]
    if key in names:  # a whole 8-digit name (saev's) wins over longer names it starts
        return [join_url(root, key)]
    return [join_url(root, n) for n in names if n.startswith(key)]


def _ambiguous(text: str, matches: list[str]) -> AmbiguousPrefixError:
    shown = "\n".join(f"  {m}" for m in matches[:20])
    return AmbiguousPrefixError(
        f"hash prefix {text!r} is ambiguous: {len(matches)} caches match; give more digits:\n{shown}", matches
    )


def locate(ref: PathLike, roots: Roots = None) -> Path | str:
    """The cache ``ref`` names: a URL (hash prefixes resolved in its root), else `resolve` in
    the local shards roots, else the hash (prefix) looked up in the remote roots given
    (``--root s3://...``) or listed in ``$SAEV_SHARDS_ROOT``."""
    if is_url(ref):
        return resolve_remote(str(ref))
    remote = remote_roots(roots)
    try:
        return resolve(ref, local_roots(roots))
    except UnknownCacheError:
        text = os.fspath(ref).strip().lower()
        if not remote or not _HEX_RE.fullmatch(text):
            raise
    found: list[str] = []
    for root in remote:
        if len(text) == 64:
            if Client(root).head(f"{text}/{MANIFEST_FILE}") is not None:
                found.append(join_url(root, text))
        elif Client(root).can_list:
            found += _matches(root, text)
    if len(found) == 1:
        return found[0]
    if not found:
        raise UnknownCacheError(f"no cache matches hash prefix {text!r} in the shards roots or in {', '.join(remote)}")
    raise _ambiguous(text, found)
