"""Earlier home of the remote storage, kept so that ``saev_shards.remote`` imports keep working:
everything moved to `saev_shards.storage` (`storage.url`, `storage.client`,
`storage.blockcache`, and `storage.remote` for what was ``remote.files``), where local and
remote storage are two peers behind one interface (`storage.base.Files`). New code imports
from there."""

from __future__ import annotations

from ..storage.url import REMOTE_SCHEMES, is_url, join_url, split_url

__all__ = ["REMOTE_SCHEMES", "is_url", "join_url", "split_url"]
