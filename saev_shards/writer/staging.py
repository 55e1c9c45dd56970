"""The lock that guards a staging directory (protocol.md section 6).

The lock file, ``<root>/.staging-<HASH>.lock``, sits beside the staging directory so the
publishing rename never moves it (the names live in `saev_shards.protocol.staging`). A
single writer or `finalize` holds it exclusively, each of several writers shares it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import AlreadyPublishedError, WriterBusyError
from ..fileio import fault_point, take_lock
from ..protocol.metadata import Metadata
from ..protocol.staging import lock_path, staging_dir


def take_writer_lock(root: Path, md: Metadata, *, shared: bool, busy: str) -> int:
    """Lock ``md``'s staging directory for writing (``shared`` among several writers) or
    finalizing; `AlreadyPublishedError` if the cache is published, `WriterBusyError` if held."""
    final = root / md.hash
    fault_point("writer-start")
    if final.exists():
        _forget_lock(root, md)
        raise already_published(final)
    fd = take_lock(lock_path(root, md), shared=shared)
    if fd is None:
        raise WriterBusyError(busy)
    fault_point("writer-lock")
    if final.exists():  # published while we waited for the lock: every holder sees it from now on
        os.close(fd)
        _forget_lock(root, md)
        raise already_published(final)
    return fd


def already_published(final: Path) -> AlreadyPublishedError:
    """What a second write of a published cache is told (in a notebook: re-running a cell)."""
    return AlreadyPublishedError(
        f"{final} is already published; published caches are immutable: read it with ss.open(path) "
        f"(or by a prefix of its hash in the shards root, ss.open({final.name[:8]!r})), or remove it with "
        f"`saev-shards rm {final.name[:12]}` to write it again"
    )


def _forget_lock(root: Path, md: Metadata) -> None:
    """Remove the lock file a published cache no longer needs (left by a kill after the
    rename), if nobody holds it; removing it while it is held would let two processes lock."""
    path = lock_path(root, md)
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        fd = take_lock(path)
        if fd is not None:
            try:
                if not staging_dir(root, md).exists():
                    path.unlink()
            finally:
                os.close(fd)
