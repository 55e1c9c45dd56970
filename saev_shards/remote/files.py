"""Earlier name of `saev_shards.storage.remote` (kept for imports): `RemoteFiles`, with its units
in `saev_shards.storage.units` and the JSON files of a remote cache in
`saev_shards.storage.remote_json` now."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidCacheError, Problem
from ..storage.remote import RemoteFiles
from ..storage.remote_json import fetch_json, forget_json, local_folder
from ..storage.units import (
    MAX_MEMORY,
    MAX_OPEN,
    MAX_PENDING_WRITES,
    STREAM_CHUNK,
    VERIFY_ATTEMPTS,
    VERIFY_BACKOFF,
    Unit,
    describe,
)

__all__ = [
    "MAX_MEMORY",
    "MAX_OPEN",
    "MAX_PENDING_WRITES",
    "STREAM_CHUNK",
    "VERIFY_ATTEMPTS",
    "VERIFY_BACKOFF",
    "RemoteFiles",
    "Unit",
    "describe",
    "fetch_json",
    "forget_json",
    "local_folder",
    "refetch_json",
]


def refetch_json(
    files: RemoteFiles, name: str, max_bytes: int, kind: type[InvalidCacheError]
) -> tuple[Any, list[Problem]]:
    """The JSON file ``name`` read again from the server: `RemoteFiles.read_json`."""
    return files.read_json(name, max_bytes, kind)
