"""Earlier home of remote roots and `push`, kept for imports: listing and resolving moved to
`saev_shards.store.remote_roots` (``locate`` is `find_cache` there), `push` to
`saev_shards.store.copies`."""

from __future__ import annotations

from ..storage.transfer import PUSH_FILES
from .copies import PushReport, push
from .remote_roots import (
    RemoteEntry,
    find_cache,
    list_remote,
    locate,
    nested_roots,
    remote_objects,
    remove_remote,
    resolve_remote,
)

__all__ = [
    "PUSH_FILES",
    "PushReport",
    "RemoteEntry",
    "find_cache",
    "list_remote",
    "locate",
    "nested_roots",
    "push",
    "remote_objects",
    "remove_remote",
    "resolve_remote",
]
