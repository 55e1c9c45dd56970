"""The JSON files of a remote cache kept on this node: fetched into a folder of the block cache
laid out like a shards root (``roots/<id of its root>/<HASH>``), so that the reader's checks of
metadata.json, shards.json and blocks.json (and of the statistics sidecar beside them) run as
for a local cache (`reader.open.open_remote`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import CacheRefError, NotRegularFileError, RemoteBucketError
from ..fileio import open_regular, write_file_atomic
from .blockcache import BlockCache, _Unwritable
from .client import Client
from .url import check_url, split_url, strip

T = TypeVar("T")


def in_block_cache_or_memory(cache: BlockCache, attempt: Callable[[bool], T]) -> T:
    """``attempt(memory)`` with the JSON files in the block cache (``memory`` False); where
    they cannot be written there (a full disk, a folder that cannot be written), once more
    with them in memory (`folders.memory_folder`), after one warning that pauses the block
    cache's writes, so the blocks read are kept in memory too. The `OSError` itself when
    even memory cannot take them."""
    try:
        return attempt(False)
    except _Unwritable as err:
        cache.pause_writes(err.error)
    try:
        return attempt(True)
    except _Unwritable as err:
        raise err.error from None


def fetch_json(client: Client, folder: Path, name: str, max_bytes: int, mode: int = 0o600) -> bool:
    """Download the JSON file ``name`` of the cache behind ``client`` into ``folder`` (atomically,
    as a file of ``mode``, never through a link); False, leaving no local copy, when the server
    has none. `JSONFileError` when it is larger than ``max_bytes`` (no more than ``max_bytes +
    1`` bytes of it are read); `blockcache._Unwritable` when ``folder`` cannot be written."""
    try:
        data = client.get_bytes(name, max_bytes)
    except RemoteBucketError:
        raise
    except FileNotFoundError:
        forget_json(folder, name)
        return False
    if _holds(folder / name, data):
        # Left in place: another process of this node may be reading this very file (a
        # published cache never changes, so the same URL gives the same bytes); replacing it
        # would swap the file under that reader between its lstat and its open.
        return True
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            write_file_atomic(folder / name, data, durable=False, dir_fd=fd, mode=mode)
        finally:
            os.close(fd)
    except OSError as err:
        raise _Unwritable(err) from None
    return True


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a regular file holding exactly ``data`` (never through a link)."""
    try:
        with open_regular(path) as f:
            return os.fstat(f.fileno()).st_size == len(data) and f.read(len(data) + 1) == data
    except (OSError, NotRegularFileError):
        return False


def forget_json(folder: Path, name: str) -> None:
    """Remove the local copy of ``name`` in ``folder`` (never through a link), if any."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
    except OSError as err:
        raise _Unwritable(err) from None
    finally:
        os.close(fd)


def local_folder(cache: BlockCache, url: str, memory: bool = False) -> Path:
    """Where the JSON files of the remote cache ``url`` are kept on this node (made, no link
    followed): ``<block cache>/roots/<id of its root>/<HASH>``, a folder laid out like a shards
    root, so the reader's checks of those files (and the statistics sidecar beside them) run as
    for a local cache; the same in `folders.memory_folder` with ``memory`` or when the block
    cache is disabled. The URL's segments are checked first (`url.check_url`: no ``..``)."""
    root, name = split_url(check_url(strip(url)))
    if not name:
        raise CacheRefError(f"{url}: expected the URL of a cache (<root>/<hash>), found a bucket or server alone")
    return cache.json_folder(root, name, memory)
