"""`open`: a cache directory, validated up front without reading shards (protocol.md section 7).

Every check collects `Problem`s and `open` raises them together; the checks are plain
functions over the parsed metadata and manifest, so `Shards` starts from a cache known to
be whole. Paths only: resolving a hash or a prefix is the store's job (`store.open_cache`),
and this package never imports the store.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import (
    CacheNotFoundError,
    HashMismatchError,
    InvalidCacheError,
    JSONFileError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    Problem,
    ProtocolVersionError,
    ProtocolWarning,
    raise_problems,
)
from ..protocol import DIALECTS, is_cache_name
from ..protocol.common import (
    BLOCKS_FILE,
    CHECKSUMS_FILE,
    MANIFEST_FILE,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    manifest_max_bytes,
    stats_max_bytes,
)
from ..protocol.jsonfile import load_json, short_repr
from ..protocol.manifest import Manifest
from ..protocol.metadata import Metadata, parse_metadata
from ..storage.url import is_url
from .manifest_checks import check_files, check_other_files, check_scales, check_shards
from .shards import Shards
from .sidecars import SIDECAR_DIR

if TYPE_CHECKING:
    from ..storage.blockcache import BlockCache

PathLike = str | os.PathLike[str]


def open(path: PathLike, *, check_hash: bool = True) -> Shards:
    """Open the cache at the directory ``path``, checking everything that can be checked
    without reading shards.

    ``path`` is a path, nothing else: `saev_shards.open` (`store.open_cache`) also takes a
    full hash or a unique hash prefix, resolves it in the shards roots and calls this. A
    path through symbolic links (a run's ``links/train-shards``) is resolved once;
    `Shards.path` is the real directory, and its name is what must equal the hash.

    ``path`` may also be the URL of a cache in an object store or on an HTTP server
    (``s3://bucket/root/<hash>``, ``https://host/root/<hash>``): `open_remote`.

    Checks (protocol.md section 7): both JSON files are strict JSON (`protocol.jsonfile`)
    of bounded size with exact key sets and types, a known protocol version, the directory
    name equals the metadata hash (unless ``check_hash=False``), shard names and counts,
    every listed file exists, is a regular file (not a symbolic link) and has exactly the
    expected size, and no unlisted data file exists. Every problem is collected and raised
    at once (see `errors`).
    """
    if is_url(path):
        return open_remote(str(path), check_hash=check_hash)
    root = Path(os.path.realpath(Path(path).absolute()))
    where = str(root)
    if not root.exists():
        raise CacheNotFoundError(f"no cache at {where}: no such file or directory")
    if not root.is_dir():
        raise CacheNotFoundError(f"{where} is not a directory")
    md, problems = _load_metadata(root, check_hash)
    if md is None:
        raise_problems(problems, where)
        raise AssertionError("unreachable")
    manifest, more = _load_manifest(root, md)
    problems.extend(more)
    raise_problems(problems, where)
    assert manifest is not None
    if md.rules.legacy:
        _warn_legacy_once(root, md)
    return Shards(root, md, manifest)


def open_remote(url: str, *, check_hash: bool = True) -> Shards:
    """Open the remote cache at ``url`` by reading its JSON files only (protocol.md 7).

    The URL's segments are checked first (no ``..``: `storage.url.check_url`). metadata.json
    and shards.json are fetched (and blocks.json where the manifest lists it, and the
    statistics sidecar of the root where there is one) into a local folder of the block cache
    (`storage.remote_json.local_folder`), then checked exactly as for a local cache, less what
    needs the data files: they are checked as they are read, every block against its digest
    (`storage.remote.RemoteFiles`), and by `Shards.verify`. Messages name URLs. Where the block
    cache cannot be written (a full disk) the JSON files go to a folder in memory, with one
    warning, and so do the blocks read; so they do when the block cache is disabled
    (``SAEV_SHARDS_BLOCK_CACHE_BYTES=0``).
    """
    from ..storage.blockcache import BlockCache
    from ..storage.remote_json import in_block_cache_or_memory
    from ..storage.url import check_url, strip

    url = strip(check_url(url))
    cache = BlockCache()
    return in_block_cache_or_memory(cache, lambda memory: _open_remote_in(url, cache, memory, check_hash))


def _open_remote_in(url: str, cache: BlockCache, memory: bool, check_hash: bool) -> Shards:
    """`open_remote` with the JSON files kept in the block cache, or in memory."""
    from ..storage.client import Client
    from ..storage.remote import RemoteFiles
    from ..storage.remote_json import fetch_json, forget_json, local_folder
    from ..storage.url import join_url, split_url

    folder = local_folder(cache, url, memory)
    mode = 0o600 if memory or cache.disabled else cache.file_mode
    client = Client(url)

    def fetch(name: str, max_bytes: int, kind: type[InvalidCacheError]) -> bool:
        try:
            return fetch_json(client, folder, name, max_bytes, mode)
        except JSONFileError as err:
            raise_problems([Problem(kind, str(err))], url)
            raise AssertionError("unreachable") from None

    if not fetch(METADATA_FILE, MAX_METADATA_BYTES, MetadataFileError):
        raise CacheNotFoundError(f"no cache at {url}: it has no {METADATA_FILE}")
    md, problems = _load_metadata(folder, check_hash)
    if md is None:
        raise_problems(_at_url(problems, folder, url), url)
        raise AssertionError("unreachable")
    if md.rules.legacy:
        raise ManifestError(
            f"{url}: a protocol {md.protocol} cache ({md.rules.summary}): remote caches are read in protocol 3 "
            f"only, whose manifest has a digest for every file; convert it first "
            f"(`saev-shards convert <local copy> --to 3.0`), then push it"
        )
    if not fetch(MANIFEST_FILE, manifest_max_bytes(md.n_shards), ManifestError):
        raise CacheNotFoundError(
            f"no cache at {url}: it has {METADATA_FILE} but no {MANIFEST_FILE} (an upload in progress, or interrupted)"
        )
    manifest, more = md.rules.load_manifest(folder, md)
    problems.extend(more)
    if manifest is not None and not more:
        problems.extend(check_shards(folder, md, manifest, on_disk=False))
        if manifest.scales is not None:
            problems.extend(check_scales(folder, md, manifest, on_disk=False))
        problems.extend(check_other_files(folder, md, manifest, on_disk=False))
    raise_problems(_at_url(problems, folder, url), url)
    assert manifest is not None
    if manifest.stats is None:  # statistics computed later, kept in the root beside the cache
        sidecars = Client(join_url(split_url(url)[0], SIDECAR_DIR))
        cap = stats_max_bytes(md.n_layers, md.d_model) + 4096
        fetch_json(sidecars, folder.parent / SIDECAR_DIR, f"{md.hash}.json", cap, mode)
    if manifest.blocks is not None:  # protocol 3.1: checked against shards.json on first use
        fetch(manifest.blocks.name, manifest.blocks.nbytes, ManifestError)
    else:
        forget_json(folder, BLOCKS_FILE)  # left by another cache of this name
    files = RemoteFiles(url, {name: (nbytes, digest) for name, nbytes, digest in manifest.files()}, cache, folder)
    shards = Shards(folder, md, manifest, files=files)
    block_size = shards.block_size
    if block_size:  # every read verified per block; without blocks.json, per whole file
        files.use_blocks(block_size, shards.block_digests)
    return shards


def _at_url(problems: list[Problem], folder: Path, url: str) -> list[Problem]:
    """The problems found in the local copies of a remote cache's JSON files, naming the URL."""
    return [Problem(p.kind, p.message.replace(str(folder), url)) for p in problems]


#: Caches (resolved paths) whose protocol warning this process has shown: a saev user opens
#: the same caches again and again (a command may open one twice), and one line says it all.
_LEGACY_WARNED: set[str] = set()


def _warn_legacy_once(root: Path, md: Metadata) -> None:
    """One short `ProtocolWarning` per legacy cache per process (protocol.md section 8)."""
    key = str(root.resolve())
    if key in _LEGACY_WARNED:
        return
    _LEGACY_WARNED.add(key)
    if md.rules.history:
        message = (
            f"{root.name[:12]}: a cache of {md.rules.summary} (dialect {md.rules.name}), read in place by "
            "protocol.md section 9.5 (no checksums: verify checks sizes, the name and the zero padding)"
        )
    else:
        message = (
            f"{root.name[:12]}: protocol {md.protocol} cache ({md.rules.name} dialect), read by protocol.md "
            f"section 9 (no checksums unless {CHECKSUMS_FILE})"
        )
    warnings.warn(message, ProtocolWarning, stacklevel=3)


def _load_metadata(root: Path, check_hash: bool) -> tuple[Metadata | None, list[Problem]]:
    path = root / METADATA_FILE
    obj, problems = load_json(path, MAX_METADATA_BYTES, MetadataFileError)
    if problems:
        return None, problems
    try:
        md = parse_metadata(obj, root.name)
    except ProtocolVersionError as err:
        raise ProtocolVersionError(f"{path}: {err}") from None
    except MetadataError as err:
        return None, [Problem(MetadataFileError, f"{path}: {err}")]
    if check_hash and root.name != md.hash:
        problems.append(Problem(HashMismatchError, _hash_mismatch(root, md)))
    return md, problems


def _hash_mismatch(root: Path, md: Metadata) -> str:
    """The message for a cache ``root`` whose name is not the hash of its metadata ``md``:
    the rule of its dialect, and every name the same metadata.json may have (saev 2.0's two)."""
    detail = "" if is_cache_name(root.name) else f" (the directory name is not a {len(md.hash)}-digit hash)"
    expected = md.hash
    if md.rules.name_rule():
        names = [f"{md.hash} ({md.rules.name_rule()})"]
        names += [f"{md.replace(dialect=s).hash} ({DIALECTS[s].name_rule()})" for s in md.rules.siblings]
        expected = " or ".join(names)
    return (
        f"{root}: directory name is not the hash of its metadata.json{detail}; "
        f"expected {expected}, found {short_repr(root.name)}"
    )


def _load_manifest(root: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
    manifest, problems = md.rules.load_manifest(root, md)
    if manifest is None or problems:
        return manifest, problems
    problems.extend(check_shards(root, md, manifest))
    empty = manifest.empty_shards
    problems.extend(check_files(root, empty.names, empty.sizes))
    if manifest.scales is not None:
        problems.extend(check_scales(root, md, manifest))
    problems.extend(check_other_files(root, md, manifest))
    return manifest, problems
