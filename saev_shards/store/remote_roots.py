"""Shards roots in object stores: list and resolve what they hold (`list_remote`,
`resolve_remote`, `find_cache`), and remove a cache from one (`remove_remote`).

A remote shards root (``s3://bucket/prefix``, protocol.md 6.1) is laid out as a local one:
``<root>/<HASH>/<files>`` and ``<root>/.stats/<HASH>.json``. A cache there is published when
its shards.json exists: until then (an upload in progress, or interrupted) no listing or
reader takes its objects for a cache. Copies into and out of a remote root are
`copies.push` and `copies.pull`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import reader
from ..errors import (
    AmbiguousPrefixError,
    CacheRefError,
    RemoteError,
    ShardsError,
    UnknownCacheError,
)
from ..protocol import is_cache_name
from ..protocol.common import MANIFEST_FILE
from ..protocol.metadata import Metadata
from ..reader.sidecars import SIDECAR_DIR
from ..storage.client import Client
from ..storage.transfer import PUSH_FILES
from ..storage.url import is_url, join_url, split_url, strip
from .roots import MIN_PREFIX, PathLike, Roots, local_roots, remote_roots, resolve

_HEX_RE = re.compile(r"[0-9a-f]{1,64}")


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


def find_cache(ref: PathLike, roots: Roots = None) -> Path | str:
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


#: The earlier name of `find_cache` (``store.locate``), kept for callers.
locate = find_cache
