"""The staging layout: names in and around a staging directory (protocol.md section 6).

``<root>/.staging-<HASH>/`` holds a cache while it is written; its lock file,
``<root>/.staging-<HASH>.lock``, sits beside it so the publishing rename never moves it.
The writer writes these names, the store finds and judges what they left behind, and
both import them from here (the lock itself is taken by `saev_shards.writer.staging`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from .common import scales_name, shard_name

if TYPE_CHECKING:
    from .metadata import Metadata

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


_PART_RECORD_RE = re.compile(r"part(\d{6})\.json")


def part_record_shard(name: str) -> int | None:
    """The shard a part record seals (``part000003.json`` -> 3); None for any other name."""
    match = _PART_RECORD_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def part_file(k: int, stream: str) -> str:
    """Name of stream ``stream``'s part of shard ``k`` (activations and their scales, which
    are published as written, use their final names)."""
    if stream == ACTS:
        return shard_name(k)
    if stream == SCALES:
        return scales_name(k)
    suffix = ".jsonl" if stream.startswith("text.") else ".bin"
    return f"part{k:06d}.{stream}{suffix}"


def is_staging_only(name: str) -> bool:
    """Files that exist only while writing: parts, part records, temporary files, rank locks."""
    return (
        name.startswith("part")
        or name.endswith(".tmp")
        or name == OLD_LOCK_FILE
        or (name.startswith(".shards-") and name.endswith(LOCK_SUFFIX))
    )
