"""Earlier name of `saev_shards.storage.url` (kept for imports)."""

from __future__ import annotations

from ..storage.url import REMOTE_SCHEMES, check_url, is_url, join_url, scheme, split_roots, split_url, strip

__all__ = ["REMOTE_SCHEMES", "check_url", "is_url", "join_url", "scheme", "split_roots", "split_url", "strip"]
