"""Protocol 3.1 (protocol.md sections 2.2, 2.10, 4 and 5): protocol 3.0 plus two optional files.

* dtype ``float8_e4m3``: the shard files keep their layout at one byte per value, and each
  shard has a scale file ``scales<06d>.bin`` of one little-endian float32 per ``(example,
  layer, token)`` vector, listed in shards.json's ``scales`` array (one file entry per shard,
  null for every other dtype);
* blocks.json, in every 3.1 cache: the xxh3_128 digest of every block of every other listed
  file, listed in shards.json's ``blocks`` file entry.

Everything else (metadata.json and its hash, the other keys of shards.json) is 3.0's (`v3`).
"""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import JSONFileError, ManifestError, NotRegularFileError, Problem
from . import v3
from .checks import JSONChecks
from .common import (
    BLOCK_SIZE,
    BLOCKS_FILE,
    FLOAT8,
    MANIFEST_FILE,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    PROTOCOL,
    blocks_max_bytes,
    manifest_max_bytes,
    n_blocks,
)
from .jsonfile import is_int, load_json, read_capped, short_repr, strict_json_loads, type_name
from .manifest import BlockDigests, FileEntry, Manifest, ShardList

if TYPE_CHECKING:
    from .metadata import Metadata

#: shards.json's top-level keys beyond 3.0's.
TOP_KEYS = ("scales", "blocks")
#: blocks.json's keys.
BLOCKS_KEYS = ("block_size", "files")


class V31(v3.V3):
    """Protocol 3.1."""

    name = PROTOCOL
    summary = "protocol 3.1"
    protocols = (PROTOCOL,)
    block_size = BLOCK_SIZE

    def load_manifest(self, folder: Path, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
        path = folder / MANIFEST_FILE
        cap = manifest_max_bytes(md.n_shards, 2 if md.dtype == FLOAT8 else 1)
        obj, problems = load_json(path, cap, ManifestError, every_number=False)
        if problems:
            return None, problems
        return parse_manifest(obj, str(path), md)

    def manifest_bytes(self, manifest: Manifest, md: Metadata) -> bytes:
        return v3.manifest_bytes(manifest, manifest_json(manifest))


DIALECT = V31()


# -- shards.json ------------------------------------------------------------------------------


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    """The JSON object written as a 3.1 shards.json: 3.0's, ``scales`` and ``blocks``."""
    if manifest.blocks is None:
        raise ValueError("a protocol 3.1 manifest lists blocks.json")
    obj = v3.manifest_json(manifest)
    scales = manifest.scales
    obj["scales"] = (
        None
        if scales is None
        else [
            {"name": n, "nbytes": b, "xxh3_128": d}
            for n, b, d in zip(scales.names, scales.sizes, scales.digests, strict=True)
        ]
    )
    obj["blocks"] = {
        "name": manifest.blocks.name,
        "nbytes": manifest.blocks.nbytes,
        "xxh3_128": manifest.blocks.xxh3_128,
    }
    return obj


def parse_manifest(obj: object, path: str, md: Metadata) -> tuple[Manifest | None, list[Problem]]:
    """Parse a 3.1 shards.json of a cache of ``md``: 3.0's keys, then ``scales`` (an array of
    file entries for float8_e4m3, else null) and ``blocks`` (a file entry)."""

    def more(c: JSONChecks, top: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        scales = top["scales"]
        if md.dtype == FLOAT8:
            if isinstance(scales, list):
                out["scales"] = _scale_entries(c, scales, top["shards"])
            else:
                c.expected("scales", "an array with one file entry per shard (dtype float8_e4m3)", type_name(scales))
        elif scales is not None:
            c.expected("scales", f"null (dtype {md.dtype} has no scale files)", short_repr(scales))
        out["blocks"] = v3.parse_file_entry(c, "blocks", top["blocks"], BLOCKS_FILE)
        return out

    return v3.parse_manifest(obj, path, TOP_KEYS, more)


_FILE_KEYS = ("name", "nbytes", "xxh3_128")
_FILE_KEYSET = frozenset(_FILE_KEYS)
_DIGESTS_RE = re.compile(r"(?:[0-9a-f]{32}\n)*")


def _scale_entries(c: JSONChecks, entries: list[Any], shards: object) -> ShardList:
    """The scale files' entries as a `ShardList` whose counts are the shards' (names are
    checked against their positions by `open`, as the shards' are)."""
    rows = _fast_files(entries)
    if rows is None:
        rows = ([], [], [])
        for i, e in enumerate(entries):
            where = f"scales[{i}]"
            if not c.keys(where, e, _FILE_KEYS):
                continue
            name = e["name"]
            if not isinstance(name, str):
                c.expected(f"{where}.name", "a string", type_name(name))
            nbytes = c.count(f"{where}.nbytes", e["nbytes"])
            digest = c.digest(f"{where}.xxh3_128", e["xxh3_128"])
            if isinstance(name, str) and nbytes is not None and digest is not None:
                rows[0].append(name)
                rows[1].append(nbytes)
                rows[2].append(digest)
    names, sizes, digests = rows
    given: list[Any] = (
        [e.get("n_examples") if isinstance(e, dict) else None for e in shards] if isinstance(shards, list) else []
    )
    counts = [c if is_int(c) else 0 for c in given] if len(given) == len(names) else [0] * len(names)
    return ShardList(names, counts, sizes, digests)  # with counts [0, ...]: `open` reports the mismatch


def _fast_files(entries: list[Any]) -> tuple[list[Any], list[Any], list[Any]] | None:
    """Columns of a well-formed array of file entries in a few passes (as `v3._fast_shards`);
    None if anything is off."""
    try:
        if set(map(type, entries)) - {dict} or set(map(len, entries)) - {len(_FILE_KEYS)}:
            return None
        names, sizes, digests = (list(map(operator.itemgetter(key), entries)) for key in _FILE_KEYS)
        if (
            set(map(type, names)) - {str}
            or set(map(type, sizes)) - {int}
            or set(map(type, digests)) - {str}
            or min(sizes, default=0) < 0
            or set(map(len, digests)) - {32}
            or not _DIGESTS_RE.fullmatch("\n".join(digests) + "\n" if digests else "")
        ):
            return None
    except (TypeError, KeyError):
        return None
    return names, sizes, digests


# -- blocks.json ------------------------------------------------------------------------------


def blocks_bytes(block_size: int, files: dict[str, list[str]]) -> bytes:
    """blocks.json as written: sorted keys, 2-space indent, one line per file."""
    if files:
        lines = ",\n".join(
            f"    {json.dumps(name, ensure_ascii=False)}: {json.dumps(digests, separators=(', ', ': '))}"
            for name, digests in sorted(files.items())
        )
        body = "{\n" + lines + "\n  }"
    else:
        body = "{}"
    return ('{\n  "block_size": ' + str(block_size) + ',\n  "files": ' + body + "\n}\n").encode("utf-8")


def blocks_entry(data: bytes) -> FileEntry:
    """shards.json's ``blocks`` entry for blocks.json of bytes ``data``."""
    return FileEntry(BLOCKS_FILE, len(data), xxhash.xxh3_128_hexdigest(data))


def load_blocks(folder: Path, manifest: Manifest) -> BlockDigests:
    """Read blocks.json of the cache in ``folder`` and check it: its size and xxh3_128 against
    ``manifest.blocks``, strict JSON (protocol.md 2), then its schema (2.10): `ManifestError`
    listing every problem."""
    entry = manifest.blocks
    if entry is None:
        raise ValueError("the manifest lists no blocks.json")
    path = folder / entry.name
    sizes = [n for _, n, _ in manifest.blocked_files()]
    try:
        data = read_capped(path, min(entry.nbytes, blocks_max_bytes(sizes)))
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except (JSONFileError, NotRegularFileError) as err:
        raise ManifestError(str(err)) from None
    if len(data) != entry.nbytes:
        raise ManifestError(f"{path}: expected {entry.nbytes} bytes (shards.json), found {len(data)}")
    digest = xxhash.xxh3_128_hexdigest(data)
    if digest != entry.xxh3_128:
        raise ManifestError(f"{path}: xxh3_128 expected {entry.xxh3_128} (shards.json), found {digest}")
    try:
        obj = strict_json_loads(data, every_number=False)  # every number is type-checked below
    except JSONFileError as err:
        raise ManifestError(f"{path}: {err}") from None
    return parse_blocks(obj, manifest, str(path))


def parse_blocks(obj: object, manifest: Manifest, path: str) -> BlockDigests:
    """Check parsed blocks.json against ``manifest`` (exactly one list per file of
    `Manifest.blocked_files`, as many digests as the file has blocks) and return it."""
    c = JSONChecks(path)
    if not c.keys("top level", obj, BLOCKS_KEYS):
        c.raise_if_any()
    assert isinstance(obj, dict)
    block_size = obj["block_size"]
    if not (
        is_int(block_size) and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0
    ):
        c.expected(
            "block_size",
            f"a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
            f"{type_name(block_size)} {short_repr(block_size)}",
        )
        c.raise_if_any()
    files = obj["files"]
    if not isinstance(files, dict):
        c.expected("files", "an object", type_name(files))
        c.raise_if_any()
    listed = {name: nbytes for name, nbytes, _ in manifest.blocked_files()}
    missing = [name for name in listed if name not in files]
    unknown = [name for name in files if name not in listed]
    if missing:
        c.add(f"files: missing lists for {short_repr(missing)}", field="files")
    if unknown:
        c.add(f"files: lists for files shards.json does not list: {short_repr(unknown)}", field="files")
    for name, digests in files.items():
        if name not in listed:
            continue
        want = n_blocks(listed[name], block_size)
        if not (
            isinstance(digests, list)
            and len(digests) == want
            and set(map(type, digests)) <= {str}
            and set(map(len, digests)) <= {32}
            and _DIGESTS_RE.fullmatch("\n".join(digests) + "\n" if digests else "")
        ):
            c.expected(f"files.{name}", f"{want} digests of 32 lower-case hex digits", short_repr(digests))
    c.raise_if_any()
    return BlockDigests(block_size, files)
