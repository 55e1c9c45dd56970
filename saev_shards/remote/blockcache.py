"""Earlier name of `saev_shards.storage.blockcache` (kept for imports; its folder helpers are in
`saev_shards.storage.folders` now)."""

from __future__ import annotations

from ..storage.blockcache import (
    CACHE_ENV,
    DEFAULT_LIMIT,
    FULL_PAUSE,
    LIMIT_ENV,
    STALE_SECONDS,
    TRIM_TO,
    BlockCache,
    TempEntry,
    default_folder,
    digest_of,
    parse_limit,
    root_id,
)
from ..storage.folders import PRIVATE_MODES, SHARED_MODES, memory_folder

__all__ = [
    "CACHE_ENV",
    "DEFAULT_LIMIT",
    "FULL_PAUSE",
    "LIMIT_ENV",
    "PRIVATE_MODES",
    "SHARED_MODES",
    "STALE_SECONDS",
    "TRIM_TO",
    "BlockCache",
    "TempEntry",
    "default_folder",
    "digest_of",
    "memory_folder",
    "parse_limit",
    "root_id",
]
