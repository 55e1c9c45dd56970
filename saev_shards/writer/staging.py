"""Names in and around a staging directory, and the lock that guards it (protocol.md section 6).

``<root>/.staging-<HASH>/`` holds a cache while it is written; its lock file,
``<root>/.staging-<HASH>.lock``, sits beside it so the publishing rename never moves it.
A single writer or `finalize` holds the lock exclusively, each of several writers shares it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import AlreadyPublishedError, WriterBusyError
from ..fileio import fault_point, take_lock
from ..metadata import Metadata
from ..protocol.common import scales_name, shard_name

STAGING_PREFIX = ".staging-"
#: The activations' stream, and that of a float8_e4m3 cache's scales (cut at shard boundaries
#: with the activations).
ACTS = "acts"
SCALES = "scales"
#: The lock file of a staging directory sits beside it: ``<root>/.staging-<HASH>.lock``.
LOCK_SUFFIX = ".lock"
#: Where older versions kept the lock (inside the staging directory); removed when met.
OLD_LOCK_FILE = ".lock"


def staging_dir(root: Path, md: Metadata) -> Path:
    """Where ``md``'s cache is written before it is published."""
    return Path(root) / f"{STAGING_PREFIX}{md.hash}"


def lock_path(root: Path, md: Metadata) -> Path:
    """The lock file of ``md``'s staging directory (beside it, so a rename never moves it)."""
    return Path(root) / f"{STAGING_PREFIX}{md.hash}{LOCK_SUFFIX}"


def range_lock(shards: range) -> str:
    """Name of the lock file (inside staging) held by the writer of ``shards`` among several."""
    return f".shards-{shards.start:06d}-{shards.stop:06d}{LOCK_SUFFIX}"


def part_record(k: int) -> str:
    """Name of shard ``k``'s part record in the staging directory."""
    return f"part{k:06d}.json"


def part_file(k: int, stream: str) -> str:
    """Name of stream ``stream``'s part of shard ``k`` (activations and their scales, which
    are published as written, use their final names)."""
    if stream == "acts":
        return shard_name(k)
    if stream == SCALES:
        return scales_name(k)
    suffix = ".jsonl" if stream.startswith("text.") else ".bin"
    return f"part{k:06d}.{stream}{suffix}"


def _is_staging_only(name: str) -> bool:
    """Files that exist only while writing: parts, part records, temporary files, rank locks."""
    return (
        name.startswith("part")
        or name.endswith(".tmp")
        or name == OLD_LOCK_FILE
        or (name.startswith(".shards-") and name.endswith(LOCK_SUFFIX))
    )


def _take_writer_lock(root: Path, md: Metadata, *, shared: bool, busy: str) -> int:
    """Lock ``md``'s staging directory for writing (``shared`` among several writers) or
    finalizing; `AlreadyPublishedError` if the cache is published, `WriterBusyError` if held."""
    final = root / md.hash
    fault_point("writer-start")
    if final.exists():
        _forget_lock(root, md)
        raise _already_published(final)
    fd = take_lock(lock_path(root, md), shared=shared)
    if fd is None:
        raise WriterBusyError(busy)
    fault_point("writer-lock")
    if final.exists():  # published while we waited for the lock: every holder sees it from now on
        os.close(fd)
        _forget_lock(root, md)
        raise _already_published(final)
    return fd


def _already_published(final: Path) -> AlreadyPublishedError:
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
