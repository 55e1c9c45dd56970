"""`Shards.verify`: every file of a cache read again and checked against what shards.json,
blocks.json and the scale rule say, every problem named at once.

Each file's size and xxh3_128 digest are recomputed (a remote cache's from the server,
several files at once), metadata.json is parsed again and its hash compared with the folder's
name, stats.json and blocks.json are checked against their schemas, each scale file's scales
against the scale rule (protocol.md 5), and the zero padding of saev's caches (protocol.md 9)
read. Where blocks.json holds a damaged file's block digests (protocol 3.1), the problem names
the blocks that differ.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import (
    CacheNotFoundError,
    ChecksumMismatchError,
    FileSizeError,
    HashMismatchError,
    InvalidCacheError,
    ManifestError,
    MetadataError,
    MetadataFileError,
    NotRegularFileError,
    Problem,
    ScaleError,
    raise_problems,
)
from ..fileio import IO_CHUNK, open_regular
from ..progress import Progress
from ..protocol.common import CHECKSUMS_FILE, MAX_METADATA_BYTES, METADATA_FILE, SCALES_DTYPE, STATS_FILE
from ..protocol.manifest import BlockDigests
from ..protocol.metadata import parse_metadata

if TYPE_CHECKING:
    from .shards import Shards


def verify(shards: Shards, *, progress: bool | None = False, on_bytes: Callable[[int], None] | None = None) -> int:
    """Recompute every file's size and xxh3_128 digest, and the metadata hash; check
    stats.json and blocks.json against their schemas. Where blocks.json holds a damaged
    file's block digests (protocol 3.1), the message names the blocks that differ.

    A remote cache is read from the server (not from the block cache), several files at
    once, and its metadata.json fetched again. Returns the number of bytes checked.
    Raises `ChecksumMismatchError` (or `InvalidCacheError` for several kinds) listing every
    problem.
    """
    problems = metadata_problems(shards)
    files = shards.manifest.files()
    total = sum(n for _, n, _ in files)
    unchecked = [name for name, _, digest in files if digest is None]
    checked = 0
    blocks = fresh_block_digests(shards)
    scale_files = {name: k for k, name in enumerate(shards.manifest.scales.names)} if shards.manifest.scales else {}
    with Progress(total, f"verify {shards.path.name[:12]}", enabled=progress) as bar:

        def tick(n: int) -> None:
            bar.update(n)
            if on_bytes is not None:
                on_bytes(n)

        for (name, nbytes, digest), found in zip(files, hash_files(shards, files, blocks, tick), strict=True):
            where = shards.files.where(name)
            if isinstance(found, Problem):
                problems.append(found)
                continue
            size, got, block_digests = found
            checked += size
            if size != nbytes:
                problems.append(Problem(FileSizeError, f"{where}: expected {nbytes} bytes, found {size}"))
                continue
            if digest is not None and got != digest:
                listed = blocks.files.get(name) if blocks is not None else None
                damaged = _damaged_blocks(blocks, listed, block_digests, nbytes)
                problems.append(
                    Problem(ChecksumMismatchError, f"{where}: xxh3_128 expected {digest}, found {got}{damaged}")
                )
                continue
            if name == STATS_FILE:  # its bytes are intact: check what they say
                problems.extend(shards._stats_problems())
            if name in scale_files:  # a scale file: every scale one the rule gives?
                problems.extend(scale_file_problems(shards, scale_files[name]))
            if shards.manifest.blocks is not None and name == shards.manifest.blocks.name:
                problems.extend(block_digests_problems(shards))
    reported = {p.message.split(": ")[0] for p in problems}  # a file reported once: its digest or size
    problems.extend(p for p in padding_problems(shards) if p.message.split(": ")[0] not in reported)
    raise_problems(problems, shards.location)
    if unchecked and shards.metadata.rules.history:
        warnings.warn(
            f"{shards.location}: {shards.metadata.rules.summary} records no checksums: the sizes of its "
            f"{len(unchecked)} files, its name and the zero padding were checked, not the values",
            stacklevel=3,
        )
    elif unchecked:
        warnings.warn(
            f"{shards.location}: {len(unchecked)} files have no recorded checksum (protocol 2.1 without "
            f"{CHECKSUMS_FILE}); only their sizes (and the zero padding) were checked",
            stacklevel=3,
        )
    return checked


def scale_file_problems(shards: Shards, k: int) -> list[Problem]:
    """Scale file ``k`` read again (intact: its digest matched), a bounded step at a time: the
    vectors whose scale the rule cannot give (`scale_problems`), as one problem naming the
    first few and counting the rest."""
    md = shards.metadata
    per_example = md.n_layers * md.tokens_per_ex
    n, first = shards.manifest.shards.counts[k], k * shards.examples_per_shard
    step = max(1, _SCALES_STEP // max(1, per_example))
    buffer = np.empty((min(step, n), md.n_layers, md.tokens_per_ex), SCALES_DTYPE)
    found: list[str] = []
    count = 0
    for a in range(first, first + n, step):
        b = min(first + n, a + step)
        out = buffer[: b - a]
        shards._read_examples_into(a, b, out, per_example * SCALES_DTYPE.itemsize, shards.scale_fd)
        numbers = np.arange(a * per_example, b * per_example).reshape(out.shape)
        bad = shards.scale_problems(out, functools.partial(np.asarray, numbers))
        count += len(bad)
        found += [message for _, message in bad[: _LISTED_SCALES - len(found)]]
    if not count:
        return []
    more = f"; and {count - len(found)} more vectors of this file" if count > len(found) else ""
    return [Problem(ScaleError, "; ".join(found) + more)]


def metadata_problems(shards: Shards) -> list[Problem]:
    """metadata.json read again (from the server for a remote cache): the same configuration and hash?"""
    where = shards.files.where(METADATA_FILE)
    obj, problems = shards.files.read_json(METADATA_FILE, MAX_METADATA_BYTES, MetadataFileError)
    if problems:
        return problems
    try:
        current = parse_metadata(obj, shards.path.name)
    except MetadataError as err:
        return [Problem(MetadataFileError, f"{where}: {err}")]
    if current != shards.metadata:
        return [Problem(HashMismatchError, f"{where}: changed since the cache was opened")]
    if shards.path.name != current.hash:
        return [Problem(HashMismatchError, f"{shards.location}: directory name is not the hash {current.hash}")]
    return []


def padding_problems(shards: Shards) -> list[Problem]:
    """saev's caches (protocol 2.1 and its earlier formats, protocol.md 9): the bytes past the
    last example of a last shard padded to a full shard, and every byte of the empty file
    after a shard filled exactly, are zeros, as its writer's memmaps left them. The one check
    of content a cache without checksums allows."""
    md, manifest = shards.metadata, shards.manifest
    if not md.rules.padded_last:  # protocol 2.1 and earlier: local only (`open_remote` refuses them)
        return []
    regions: list[tuple[str, int, int, str]] = []
    if len(manifest.shards):
        last = manifest.shards[-1]
        data = last.n_examples * md.example_nbytes
        if last.nbytes > data:
            regions.append((last.name, data, last.nbytes, "the padding past the last example"))
    regions += [(e.name, 0, e.nbytes, "the all-zero file saev's writer left after the last shard") for e in
                manifest.empty_shards]  # fmt: skip
    problems: list[Problem] = []
    for name, start, end, what in regions:
        path = shards.path / name
        try:
            first = _first_nonzero(path, start, end)
        except (OSError, NotRegularFileError):
            continue  # reported by the size and digest checks
        if first is not None:
            problems.append(
                Problem(
                    ChecksumMismatchError,
                    f"{path}: byte {first:,} is not zero; bytes {start:,}-{end - 1:,} are {what}, which saev's "
                    "writer leaves zero (the file changed after it was written)",
                )
            )
    return problems


def hash_files(
    shards: Shards, files: list[tuple[str, int, str | None]], blocks: BlockDigests | None, tick: Callable[[int], None]
) -> Iterator[tuple[int, str, list[str]] | Problem]:
    """``(size, xxh3_128, digests of its blocks)`` of each file in order (block digests where
    ``blocks`` lists the file), or the problem reading it."""

    def block_size(name: str) -> int | None:
        return blocks.block_size if blocks is not None and name in blocks.files else None

    def one(name: str) -> tuple[int, str, list[str]] | Problem:
        try:
            return shards.files.verify_file(name, block_size(name), tick)
        except NotRegularFileError as err:
            return Problem(ManifestError, str(err))
        except CacheNotFoundError as err:
            return Problem(CacheNotFoundError, str(err))

    names = [name for name, _, _ in files]
    workers = max(1, min(len(names), shards.files.streams // 2))  # each a stream: from a server, several
    if workers == 1:
        yield from map(one, names)
        return
    with ThreadPoolExecutor(workers) as pool:
        yield from pool.map(one, names)


def fresh_block_digests(shards: Shards) -> BlockDigests | None:
    """blocks.json for `verify` to name damaged blocks with, fresh from disk; None if there
    is none or it does not check out (`verify` reports why with the rest)."""
    if shards.manifest.blocks is None:
        return None
    shards._aux.pop("blocks", None)
    try:
        return shards._blocks()
    except (InvalidCacheError, OSError):
        return None


def block_digests_problems(shards: Shards) -> list[Problem]:
    try:
        shards._blocks()
    except InvalidCacheError as err:
        return err.problems
    return []


def _first_nonzero(path: Path, start: int, end: int) -> int | None:
    """Offset of the first byte of ``path`` in ``[start, end)`` that is not zero (None: all
    zero, or the file ends first), read one chunk at a time."""
    with open_regular(path) as f:
        offset = start
        while offset < end:
            chunk = os.pread(f.fileno(), min(IO_CHUNK, end - offset), offset)
            if not chunk:
                return None
            values = np.frombuffer(chunk, dtype=np.uint8)
            if values.any():
                return offset + int(np.argmax(values != 0))
            offset += len(chunk)
    return None


#: Scales `verify` reads at a time (4 bytes each), and bad ones it names per scale file.
_SCALES_STEP = 1 << 20
_LISTED_SCALES = 3
#: Damaged blocks named in one problem of `verify` (the rest are counted).
_LISTED_BLOCKS = 5


def _damaged_blocks(blocks: BlockDigests | None, listed: Sequence[str] | None, found: list[str], nbytes: int) -> str:
    """``"; block 7 (bytes 117440512-134217727) differs"`` for the blocks of a file whose
    digests ``found`` (read now) differ from those ``listed`` in blocks.json; "" without them."""
    if blocks is None or listed is None or len(found) != len(listed):
        return ""
    bad = [i for i, (a, b) in enumerate(zip(listed, found, strict=True)) if a != b]
    if not bad:
        return ""
    spans = [f"{i} (bytes {'-'.join(map(str, blocks.span(i, nbytes)))})" for i in bad[:_LISTED_BLOCKS]]
    more = f" and {len(bad) - _LISTED_BLOCKS} more" if len(bad) > _LISTED_BLOCKS else ""
    return f"; block{'s' if len(bad) > 1 else ''} {', '.join(spans)}{more} differ{'' if len(bad) > 1 else 's'}"
