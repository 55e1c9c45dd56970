"""What every protocol version shares: file names, stored dtypes, name patterns and JSON size limits.

protocol.md is normative; the per-version rules live beside this module (`v3`, `v21`,
`saev_code`, `saev_spec`), each naming the section it implements.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

#: The protocol version this library writes by default.
PROTOCOL = "3.0"
#: The saev reference protocol (float32 only): read in both of its dialects, written as saev's code writes it.
LEGACY_PROTOCOL = "2.1"
#: Versions saev's code accepts in metadata.json, all with the same keys and layout (read and written).
SAEV_CODE_PROTOCOLS = ("2.1", "1.1", "1.0.0")
#: Every version this library reads.
SUPPORTED_PROTOCOLS = (PROTOCOL, *SAEV_CODE_PROTOCOLS)

#: Stored dtypes. Values are little-endian numpy dtypes of the raw bytes; bfloat16 has no
#: numpy dtype, so its 2 raw bytes are exposed as uint16.
DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
}
#: Stored dtypes per protocol version (every 2.1 and 1.x dialect stores float32 only).
DTYPES_BY_PROTOCOL: dict[str, tuple[str, ...]] = {
    PROTOCOL: ("float16", "bfloat16", "float32"),
    **{version: ("float32",) for version in SAEV_CODE_PROTOCOLS},
}
DEFAULT_DTYPE = "float16"

METADATA_FILE = "metadata.json"
MANIFEST_FILE = "shards.json"
LABELS_FILE = "labels.bin"
STATS_FILE = "stats.json"
#: Protocol 2.1 only: our sidecar of sizes and checksums (the 2.1 shards.json has no room).
CHECKSUMS_FILE = "checksums.json"
LABELS_DTYPE = np.dtype("|u1")

SHARD_NAME_RE = re.compile(r"acts(\d{6})\.bin")
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


def manifest_max_bytes(n_shards: int) -> int:
    """Largest shards.json (or 2.1 checksums.json) accepted for a cache of ``n_shards`` shards."""
    return JSON_SLACK_BYTES + MANIFEST_BYTES_PER_SHARD * (n_shards + 1)


def stats_max_bytes(n_layers: int, d_model: int) -> int:
    """Largest stats.json accepted: ``2 * L * D + 4 * L`` numbers."""
    return JSON_SLACK_BYTES + STATS_BYTES_PER_NUMBER * n_layers * (2 * d_model + 4)


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``acts000000.bin`` (zero-padded to 6 digits)."""
    if not 0 <= index <= 999_999:
        raise ValueError(f"shard index {index} does not fit the 6-digit name acts<06d>.bin")
    return f"acts{index:06d}.bin"


def column_file(name: str) -> str:
    """File name of per-example column ``name``."""
    return f"column.{name}.bin"


def text_file(name: str) -> str:
    """File name of per-example text field ``name`` (JSON Lines)."""
    return f"text.{name}.jsonl"
