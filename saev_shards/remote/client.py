"""Earlier name of `saev_shards.storage.client` (kept for imports)."""

from __future__ import annotations

from ..storage.client import (
    DEFAULT_REQUESTS,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    FIRST_BACKOFF,
    MAX_BACKOFF,
    PART_BYTES,
    READ_PIECE,
    REQUESTS_ENV,
    RETRIES_ENV,
    RETRY_TIMEOUTS,
    TIMEOUT_BYTES,
    TIMEOUT_ENV,
    Client,
    allowance,
    remote_error,
    requests_in_flight,
    timeout,
)

__all__ = [
    "DEFAULT_REQUESTS",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT",
    "FIRST_BACKOFF",
    "MAX_BACKOFF",
    "PART_BYTES",
    "READ_PIECE",
    "REQUESTS_ENV",
    "RETRIES_ENV",
    "RETRY_TIMEOUTS",
    "TIMEOUT_BYTES",
    "TIMEOUT_ENV",
    "Client",
    "allowance",
    "remote_error",
    "requests_in_flight",
    "timeout",
]
