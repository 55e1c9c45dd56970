"""`open`: a cache directory, validated up front without reading shards (protocol.md section 7).

Every check collects `Problem`s and `open` raises them together; the checks are plain
functions over the parsed metadata and manifest, so `Shards` starts from a cache known to
be whole. Paths only: resolving a hash or a prefix is the store's job (`store.open_cache`),
and this package never imports the store.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import (
    CacheNotFoundError,
    FileSizeError,
    HashMismatchError,
    InvalidCacheError,
    JSONFileError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    Problem,
    ProtocolVersionError,
    ProtocolWarning,
    UnexpectedFileError,
    raise_problems,
)
from ..fileio import file_kind
from ..manifest import Manifest
from ..metadata import Metadata, parse_metadata
from ..protocol import DIALECTS, is_cache_name
from ..protocol.common import (
    BLOCKS_FILE,
    CHECKSUMS_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    SCALES_NAME_RE,
    SHARD_NAME_RE,
    STATS_FILE,
    blocks_max_bytes,
    manifest_max_bytes,
    scales_name,
    stats_max_bytes,
)
from ..protocol.jsonfile import load_json, short_repr
from ..storage.url import is_url
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
    if md.format.legacy:
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
    from ..storage.blockcache import BlockCache, _Unwritable
    from ..storage.url import check_url, strip

    url = strip(check_url(url))
    cache = BlockCache()
    try:
        return _open_remote_in(url, cache, False, check_hash)
    except _Unwritable as err:
        cache.pause_writes(err.error)  # one warning; the blocks are not written either for now
    try:
        return _open_remote_in(url, cache, True, check_hash)
    except _Unwritable as err:
        raise err.error from None


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
    if md.format.legacy:
        raise ManifestError(
            f"{url}: a protocol {md.protocol} cache ({md.format.summary}): remote caches are read in protocol 3 "
            f"only, whose manifest has a digest for every file; convert it first "
            f"(`saev-shards convert <local copy> --to 3.0`), then push it"
        )
    if not fetch(MANIFEST_FILE, manifest_max_bytes(md.n_shards), ManifestError):
        raise CacheNotFoundError(
            f"no cache at {url}: it has {METADATA_FILE} but no {MANIFEST_FILE} (an upload in progress, or interrupted)"
        )
    manifest, more = md.format.load_manifest(folder, md)
    problems.extend(more)
    if manifest is not None and not more:
        problems.extend(_check_shards(folder, md, manifest, on_disk=False))
        if manifest.scales is not None:
            problems.extend(_check_scales(folder, md, manifest, on_disk=False))
        problems.extend(_check_other_files(folder, md, manifest, on_disk=False))
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
    if md.format.history:
        message = (
            f"{root.name[:12]}: a cache of {md.format.summary} (dialect {md.format.name}), read in place by "
            "protocol.md section 9.5 (no checksums: verify checks sizes, the name and the zero padding)"
        )
    else:
        message = (
            f"{root.name[:12]}: protocol {md.protocol} cache ({md.format.name} dialect), read by protocol.md "
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
    if md.format.name_rule():
        names = [f"{md.hash} ({md.format.name_rule()})"]
        names += [f"{md.replace(dialect=s).hash} ({DIALECTS[s].name_rule()})" for s in md.format.siblings]
        expected = " or ".join(names)
    return (
        f"{root}: directory name is not the hash of its metadata.json{detail}; "
        f"expected {expected}, found {short_repr(root.name)}"
    )


def _load_manifest(root: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
    manifest, problems = md.format.load_manifest(root, md)
    if manifest is None or problems:
        return manifest, problems
    problems.extend(_check_shards(root, md, manifest))
    empty = manifest.empty_shards
    problems.extend(_check_files(root, empty.names, empty.sizes))
    if manifest.scales is not None:
        problems.extend(_check_scales(root, md, manifest))
    problems.extend(_check_other_files(root, md, manifest))
    return manifest, problems


def _check_shards(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    problems: list[Problem] = []
    where = root / MANIFEST_FILE
    expected = md.n_shards
    if len(manifest.shards) != expected:
        problems.append(
            Problem(
                ManifestError,
                f"{where}: expected {expected} shards for n_examples={md.n_examples} and "
                f"examples_per_shard={md.examples_per_shard}, found {len(manifest.shards)}",
            )
        )
    eps = md.examples_per_shard
    example_nbytes = md.example_nbytes
    # One pass of list comparisons for the common, valid manifest (10^4 shards in a few ms);
    # entry-by-entry messages only for entries that differ.
    count = len(manifest.shards)
    want_names = _shard_names(min(count, 1_000_000))
    last = md.n_examples - (expected - 1) * eps
    extra = [0] * max(0, count - expected)
    want_counts = (([eps] * (expected - 1) + [last] if expected else []) + extra)[:count]
    names, counts, sizes = manifest.shards.names, manifest.shards.counts, manifest.shards.sizes
    # list arithmetic, not a loop: 10^4 shards
    full = eps * example_nbytes
    want_sizes = (([full] * (expected - 1) + [last * example_nbytes] if expected else []) + extra)[:count]
    if md.format.padded_last and count == expected and expected and sizes[-1] == full:
        want_sizes[-1] = full  # 2.1: the last shard's file padded to a full shard
    if names == want_names and counts == want_counts and sizes == want_sizes:
        if on_disk:
            problems.extend(_check_files(root, names, sizes))
        return problems
    ok_names: list[str] = []
    ok_sizes: list[int] = []
    for i, s in enumerate(manifest.shards):
        if i >= len(want_names) or s.name != want_names[i]:
            want = want_names[i] if i < len(want_names) else "(none: too many shards)"
            hint = "" if SHARD_NAME_RE.fullmatch(s.name) else " (shard names are plain acts<06d>.bin, no paths)"
            problems.append(
                Problem(ManifestError, f"{where}: shard {i}: expected name {want!r}, found {short_repr(s.name)}{hint}")
            )
        elif s.n_examples != want_counts[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected n_examples={want_counts[i]}, found {s.n_examples}")
            )
        elif s.nbytes != want_sizes[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected nbytes={want_sizes[i]}, found {s.nbytes}")
            )
        else:
            ok_names.append(s.name)
            ok_sizes.append(s.nbytes)
    if on_disk:
        problems.extend(_check_files(root, ok_names, ok_sizes))
    return problems


def _check_scales(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    """A float8_e4m3 cache's scale files (protocol 3.1): one per shard, named for it, a float32
    per vector of its examples, each a regular file of that size."""
    where = root / MANIFEST_FILE
    scales = manifest.scales
    assert scales is not None
    if len(scales) != md.n_shards:
        return [
            Problem(
                ManifestError, f"{where}: scales: expected {md.n_shards} entries (one per shard), found {len(scales)}"
            )
        ]
    problems: list[Problem] = []
    ok_names: list[str] = []
    ok_sizes: list[int] = []
    for k, (name, nbytes) in enumerate(zip(scales.names, scales.sizes, strict=True)):
        want = md.shard_scales_nbytes(k)
        if name != scales_name(k):
            problems.append(
                Problem(
                    ManifestError, f"{where}: scales[{k}]: expected name {scales_name(k)!r}, found {short_repr(name)}"
                )
            )
        elif nbytes != want:
            problems.append(Problem(ManifestError, f"{where}: {name}: expected nbytes={want}, found {nbytes}"))
        else:
            ok_names.append(name)
            ok_sizes.append(nbytes)
    if on_disk:
        problems.extend(_check_files(root, ok_names, ok_sizes))
    return problems


_SHARD_NAMES: list[str] = []


def _shard_names(count: int) -> list[str]:
    """``[acts000000.bin, ...]`` of length ``count``, built once per process and extended as needed."""
    if len(_SHARD_NAMES) < count:
        _SHARD_NAMES.extend(f"acts{i:06d}.bin" for i in range(len(_SHARD_NAMES), count))
    return _SHARD_NAMES[:count]


def _check_files(root: Path, names: Sequence[str], sizes: Sequence[int]) -> list[Problem]:
    """``lstat`` each file ``names[i]`` in ``root`` (relative to a directory fd: no path parsing)
    and check it is a regular file (a symbolic link is not) of ``sizes[i]`` bytes; one pass,
    problems worded only on failure. ``names`` are validated names: plain ``acts<06d>.bin``."""
    if not names:
        return []
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        regular = stat.S_ISREG
        bad = [
            i
            for i, (name, nbytes) in enumerate(zip(names, sizes, strict=True))
            if (st := os.stat(name, dir_fd=dir_fd, follow_symlinks=False)).st_size != nbytes or not regular(st.st_mode)
        ]
    except OSError:
        bad = list(range(len(names)))  # something is missing: the slow path words each problem
    finally:
        os.close(dir_fd)
    problems: list[Problem] = []
    for i in bad:
        problems.extend(_check_one_file(root / names[i], sizes[i]))
    return problems


def _check_one_file(path: Path, nbytes: int) -> list[Problem]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return [Problem(CacheNotFoundError, f"{path}: missing")]
    except OSError as err:
        return [Problem(CacheNotFoundError, f"{path}: cannot stat ({err.strerror})")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem(ManifestError, f"{path}: expected a regular file, found {file_kind(st.st_mode)}")]
    if st.st_size != nbytes:
        hint = " (file seems not fully written?)" if st.st_size < nbytes else ""
        return [Problem(FileSizeError, f"{path}: expected {nbytes} bytes, found {st.st_size}{hint}")]
    return []


def _check_other_files(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    """The shapes and sizes the manifest gives the files beside the shards; with ``on_disk``,
    also each file itself, and no unlisted data file in ``root``."""
    problems: list[Problem] = []
    where = root / MANIFEST_FILE

    def _check_file(path: Path, nbytes: int) -> list[Problem]:
        return _check_one_file(path, nbytes) if on_disk else []

    if manifest.labels is not None:
        want = (md.n_examples, md.patches_per_ex)
        lab = manifest.labels
        if lab.shape != want or lab.nbytes != md.n_examples * md.patches_per_ex:
            problems.append(
                Problem(ManifestError, f"{where}: labels: expected shape {list(want)} uint8, found {list(lab.shape)}")
            )
        else:
            problems.extend(_check_file(root / lab.name, lab.nbytes))
    for name, col in manifest.columns.items():
        itemsize = np.dtype(col.dtype).itemsize
        want_nbytes = int(np.prod(col.shape, dtype=object)) * itemsize
        if col.shape[0] != md.n_examples or col.nbytes != want_nbytes:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: columns.{name}: expected shape ({md.n_examples}, ...) and nbytes = "
                    f"prod(shape) * {itemsize}, found shape {list(col.shape)} nbytes {col.nbytes}",
                )
            )
        else:
            problems.extend(_check_file(root / col.name, col.nbytes))
    for name, txt in manifest.text.items():
        if txt.n_lines != md.n_examples:
            problems.append(
                Problem(ManifestError, f"{where}: text.{name}: expected n_lines={md.n_examples}, found {txt.n_lines}")
            )
        else:
            problems.extend(_check_file(root / txt.name, txt.nbytes))
    if manifest.blocks is not None:
        cap = blocks_max_bytes([n for _, n, _ in manifest.blocked_files()])
        if manifest.blocks.nbytes > cap:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: blocks.nbytes: expected at most {cap:,} bytes for the files listed, "
                    f"found {manifest.blocks.nbytes:,}",
                )
            )
        else:
            problems.extend(_check_file(root / manifest.blocks.name, manifest.blocks.nbytes))
    if manifest.stats is not None:
        cap = stats_max_bytes(md.n_layers, md.d_model)
        if manifest.stats.nbytes > cap:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: stats.nbytes: expected at most {cap:,} bytes for {md.n_layers} layers of "
                    f"{md.d_model} dimensions, found {manifest.stats.nbytes:,}",
                )
            )
        else:
            problems.extend(_check_file(root / manifest.stats.name, manifest.stats.nbytes))
    if not on_disk:
        return problems
    present = set(os.listdir(root))
    unlisted = present.difference(manifest.shards.names)  # set operations in C: 10^4 names
    unlisted.difference_update(manifest.empty_shards.names)
    unlisted.difference_update(manifest.scales.names if manifest.scales is not None else ())
    unlisted.difference_update(name for name, _, _ in manifest.other_files())
    if manifest.blocks is not None:
        unlisted.discard(manifest.blocks.name)
    v31 = md.format.block_size is not None  # the names protocol 3.1 gave a meaning
    listing = md.format.manifest_file
    unlisted_why = (
        f"not listed in {listing}"
        if listing is not None
        else f"beyond the shards of n_examples={md.n_examples} ({md.format.summary} has no {MANIFEST_FILE})"
    )
    problems.extend(
        Problem(UnexpectedFileError, f"{root / name}: data file {unlisted_why}")
        for name in sorted(unlisted)
        if SHARD_NAME_RE.fullmatch(name)
        or name in (LABELS_FILE, STATS_FILE)
        or (name.startswith(("column.", "text.")) and name.endswith((".bin", ".jsonl")))
        or (v31 and (name == BLOCKS_FILE or SCALES_NAME_RE.fullmatch(name) is not None))
    )
    return problems
