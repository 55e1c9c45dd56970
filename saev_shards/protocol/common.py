"""What every protocol version shares: file names, stored dtypes, name patterns and JSON size limits.

protocol.md is normative; the per-version rules live beside this module (`v3`, `v21`,
`saev_code`, `saev_spec`), each naming the section it implements.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

#: The protocol version this library writes by default.
PROTOCOL = "3.1"
#: The previous minor version of this library's protocol: read, and written on request
#: (``Metadata(..., protocol="3.0")``); its caches are byte-identical to those earlier releases wrote.
PROTOCOL_30 = "3.0"
#: The minor version that adds metadata.json's optional ``sites`` (what each layer slot holds,
#: protocol.md 2.1.1): written for a cache that has sites, and only then.
PROTOCOL_32 = "3.2"
#: This library's own versions (protocol.md sections 1 to 8), newest first.
V3_PROTOCOLS = (PROTOCOL_32, PROTOCOL, PROTOCOL_30)
#: The saev reference protocol (float32 only): read in both of its dialects, written as saev's code writes it.
LEGACY_PROTOCOL = "2.1"
#: Versions saev's code accepts in metadata.json, all with the same keys and layout (read and written).
SAEV_CODE_PROTOCOLS = ("2.1", "1.1", "1.0.0")
#: The ``protocol`` saev wrote in October 2025, between 1.1 and 2.1 (read only, `saev_history`).
SAEV_20_PROTOCOL = "2.0"
#: Every version this library reads in a metadata.json's ``protocol``.
SUPPORTED_PROTOCOLS = (*V3_PROTOCOLS, *SAEV_CODE_PROTOCOLS, SAEV_20_PROTOCOL)
#: `Metadata.protocol` of a cache saev wrote before it versioned its format (metadata.json
#: has no ``protocol`` key: saev 0.1.0 and earlier, `saev_history`). Never read from a file
#: nor written to one.
UNVERSIONED = "pre-1.0.0"
#: Every value `Metadata.protocol` may hold.
METADATA_PROTOCOLS = (*SUPPORTED_PROTOCOLS, UNVERSIONED)

#: The one quantized dtype (protocol 3.1): OCP FP8 E4M3, the "fn" variant (no infinities,
#: largest finite 448), one byte per value, with one float32 scale per vector beside it.
FLOAT8 = "float8_e4m3"
#: Stored dtypes. Values are little-endian numpy dtypes of the raw bytes; bfloat16 has no
#: numpy dtype, so its 2 raw bytes are exposed as uint16; float8_e4m3 is ml_dtypes' float8_e4m3fn.
DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    FLOAT8: np.dtype(ml_dtypes.float8_e4m3fn),
}
#: Stored dtypes per protocol version (every dialect of saev's stores float32 only).
DTYPES_BY_PROTOCOL: dict[str, tuple[str, ...]] = {
    PROTOCOL_32: ("float16", "bfloat16", "float32", FLOAT8),
    PROTOCOL: ("float16", "bfloat16", "float32", FLOAT8),
    PROTOCOL_30: ("float16", "bfloat16", "float32"),
    **{version: ("float32",) for version in (*SAEV_CODE_PROTOCOLS, SAEV_20_PROTOCOL, UNVERSIONED)},
}
DEFAULT_DTYPE = "float16"
#: The scale files of a float8_e4m3 cache: one little-endian float32 per (example, layer, token) vector.
SCALES_DTYPE = np.dtype("<f4")

METADATA_FILE = "metadata.json"
MANIFEST_FILE = "shards.json"
LABELS_FILE = "labels.bin"
STATS_FILE = "stats.json"
#: Protocol 2.1 only: our sidecar of sizes and checksums (the 2.1 shards.json has no room).
CHECKSUMS_FILE = "checksums.json"
#: Protocol 3.1: the xxh3_128 digest of every block of every data file.
BLOCKS_FILE = "blocks.json"
LABELS_DTYPE = np.dtype("|u1")

#: Protocol 3.1: the bytes each digest of blocks.json covers, as this library writes them
#: (the O_DIRECT block of the writer, so a block is digested as it is written), and the
#: range a reader accepts (powers of two).
BLOCK_SIZE = 16 << 20
MIN_BLOCK_SIZE = 64 << 10
MAX_BLOCK_SIZE = 1 << 30

SHARD_NAME_RE = re.compile(r"acts(\d{6})\.bin")
SCALES_NAME_RE = re.compile(r"scales(\d{6})\.bin")
#: Column and text names: short, lower-case, safe as part of a file name.
FIELD_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
#: A 64-digit hash: the name of a 3.0 cache, of a 2.1 cache of saev's protocol document, and
#: of a cache saev's code wrote before 2025-10-14.
HASH_RE = re.compile(r"[0-9a-f]{64}")
#: Every directory name a cache can have: 64 hex digits, or the 8 saev's code writes since 2025-10-14.
CACHE_NAME_RE = re.compile(r"[0-9a-f]{64}|[0-9a-f]{8}")
XXH3_RE = re.compile(r"[0-9a-f]{32}")

#: Column dtypes allowed in protocol 3.0 (numpy ``dtype.str`` spelling, little-endian).
COLUMN_DTYPES = ("|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8")

#: metadata.json describes a configuration (saev's pickled dataset config is kilobytes); a
#: larger file is not a description.
MAX_METADATA_BYTES = 16 << 20
#: The other JSON files are capped by what the metadata says, so a hostile file cannot make
#: a reader allocate more than a real cache of that shape needs: 1 MiB of slack plus
#: MANIFEST_BYTES_PER_SHARD per shard (this library writes ~120), STATS_BYTES_PER_NUMBER per
#: number of stats.json (the longest float repr is 24 characters).
JSON_SLACK_BYTES = 1 << 20
MANIFEST_BYTES_PER_SHARD = 1024
STATS_BYTES_PER_NUMBER = 64
#: blocks.json: bytes per digest (32 hex digits, quotes, a comma and a space: 36 as written)
#: and per listed file (its name, quotes, brackets, indent).
BLOCKS_BYTES_PER_DIGEST = 40
BLOCKS_BYTES_PER_FILE = 256


def manifest_max_bytes(n_shards: int, files_per_shard: int = 1) -> int:
    """Largest shards.json (or 2.1 checksums.json) accepted for a cache of ``n_shards`` shards
    with ``files_per_shard`` listed files each (2 for a float8_e4m3 cache: shard and scales)."""
    return JSON_SLACK_BYTES + MANIFEST_BYTES_PER_SHARD * files_per_shard * (n_shards + 1)


def n_blocks(nbytes: int, block_size: int) -> int:
    """Blocks of ``block_size`` a file of ``nbytes`` bytes is cut into (0 for an empty file)."""
    return -(-nbytes // block_size)


def blocks_max_bytes(sizes: list[int]) -> int:
    """Largest blocks.json accepted for data files of these sizes: its digests at the
    smallest block size a reader accepts, and its file names (protocol.md 2.10)."""
    digests = sum(n_blocks(n, MIN_BLOCK_SIZE) for n in sizes)
    return JSON_SLACK_BYTES + BLOCKS_BYTES_PER_DIGEST * digests + BLOCKS_BYTES_PER_FILE * len(sizes)


def stats_max_bytes(n_layers: int, d_model: int) -> int:
    """Largest stats.json accepted: ``2 * L * D + 4 * L`` numbers."""
    return JSON_SLACK_BYTES + STATS_BYTES_PER_NUMBER * n_layers * (2 * d_model + 4)


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``acts000000.bin`` (zero-padded to 6 digits)."""
    if not 0 <= index <= 999_999:
        raise ValueError(f"shard index {index} does not fit the 6-digit name acts<06d>.bin")
    return f"acts{index:06d}.bin"


def scales_name(index: int) -> str:
    """File name of shard ``index``'s scales (protocol 3.1, float8_e4m3): ``scales000000.bin``."""
    if not 0 <= index <= 999_999:
        raise ValueError(f"shard index {index} does not fit the 6-digit name scales<06d>.bin")
    return f"scales{index:06d}.bin"


def column_file(name: str) -> str:
    """File name of per-example column ``name``."""
    return f"column.{name}.bin"


def text_file(name: str) -> str:
    """File name of per-example text field ``name`` (JSON Lines)."""
    return f"text.{name}.jsonl"
