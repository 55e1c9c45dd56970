"""Constants and small helpers of the on-disk protocol (see protocol.md, which is normative).

Versions and dtypes are data: tables below, and one check function each that raises
with the value it got.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from typing import Any

import numpy as np

from .errors import DtypeError, ProtocolVersionError

#: The protocol version this library writes by default.
PROTOCOL = "3.0"
#: The saev reference protocol (float32 only); read, and written for dtype float32 on request.
LEGACY_PROTOCOL = "2.1"
#: Every version this library reads.
SUPPORTED_PROTOCOLS = (PROTOCOL, LEGACY_PROTOCOL)

#: Stored dtypes per protocol version. Values are little-endian numpy dtypes of the raw
#: bytes; bfloat16 has no numpy dtype, so its 2 raw bytes are exposed as uint16.
DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
}
DTYPES_BY_PROTOCOL: dict[str, tuple[str, ...]] = {
    PROTOCOL: ("float16", "bfloat16", "float32"),
    LEGACY_PROTOCOL: ("float32",),
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
HASH_RE = re.compile(r"[0-9a-f]{64}")
XXH3_RE = re.compile(r"[0-9a-f]{32}")

#: Column dtypes allowed in protocol 3.0 (numpy ``dtype.str`` spelling, little-endian).
COLUMN_DTYPES = ("|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8")


class ProtocolWarning(UserWarning):
    """Warned when a cache of an older major protocol version is read (protocol.md 7)."""


def check_version(version: object) -> str:
    """Return ``version`` if this library reads it; raise `ProtocolVersionError` otherwise."""
    if not isinstance(version, str) or version not in SUPPORTED_PROTOCOLS:
        raise ProtocolVersionError(
            f"unsupported protocol version {version!r}; this library reads "
            f"{', '.join(repr(v) for v in SUPPORTED_PROTOCOLS)}"
        )
    return version


def warn_legacy(path: str) -> None:
    """Emit the breaking-change warning protocol.md requires when reading a 2.1 cache."""
    warnings.warn(
        f"{path}: protocol {LEGACY_PROTOCOL} cache (saev reference, float32); read with the "
        f"compatibility rules of protocol.md section 7 (no checksums unless {CHECKSUMS_FILE} "
        "is present; the last shard may be padded to a full shard)",
        ProtocolWarning,
        stacklevel=3,
    )


def check_dtype(dtype: object, protocol: str) -> str:
    """Return ``dtype`` if protocol ``protocol`` allows it; raise `DtypeError` otherwise."""
    allowed = DTYPES_BY_PROTOCOL[protocol]
    if not isinstance(dtype, str) or dtype not in allowed:
        raise DtypeError(
            f"dtype {dtype!r} is not allowed in protocol {protocol}; expected one of "
            f"{', '.join(repr(d) for d in allowed)}"
        )
    return dtype


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


def canonical_json(obj: object) -> bytes:
    """The bytes the content hash is taken of: ``json.dumps(obj, sort_keys=True, separators=(',', ':'))``.

    ``ensure_ascii`` keeps its default (True), so non-ASCII text is hashed as ``\\uXXXX``
    escapes, exactly as the seed formula does.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def content_hash(metadata: dict[str, Any]) -> str:
    """``sha256(canonical_json(metadata)).hexdigest()``: all 64 hex digits."""
    return hashlib.sha256(canonical_json(metadata)).hexdigest()


def pretty_json(obj: object) -> bytes:
    """Deterministic, human-readable JSON (sorted keys, 2-space indent, UTF-8, final newline)."""
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def strict_json_loads(data: bytes) -> Any:
    """Parse JSON, rejecting NaN/Infinity and duplicate keys (raises `ValueError`)."""
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


def type_name(value: object) -> str:
    """JSON-flavoured name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_int(value: object) -> bool:
    """True for JSON integers (Python ints that are not bools)."""
    return isinstance(value, int) and not isinstance(value, bool)
