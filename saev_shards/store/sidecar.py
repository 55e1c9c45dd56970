"""Statistics for a cache written without them, kept beside it: the stats sidecar.

A published cache is immutable, so `saev-shards stats HASH` (`compute_stats` +
`write_sidecar`) does not add stats.json to it: it writes ``<root>/.stats/<hash>.json`` in
the root that holds the cache (protocol.md section 2.9), and `Shards.stats` reads it when
the cache has no stats.json of its own (`find_stats`, which lives with the reader in
`saev_shards.reader.sidecars` so the reader never imports the store; re-exported here).
The file is a JSON object:

* ``cache``: the cache's hash (the file is named by it too);
* ``manifest_xxh3_128``: the digest of the cache's shards.json when the statistics were
  computed: its checksums cover every shard, so a sidecar never describes other data;
* ``stats_xxh3_128``: the digest of ``pretty_json(stats)``, so damage to the numbers shows;
* ``stats``: the stats.json object (protocol.md 2.6), exactly what the writer would have
  written with ``stats=True`` (same sums in the same order).

Each is checked on every read; a sidecar that fails is a `StatsFileError` naming it and
saying how to make it again, never silently ignored.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from .. import reader
from ..errors import StatsFileError
from ..fileio import file_kind, naming_disk_full, write_file_atomic
from ..progress import Progress
from ..protocol.v3 import parse_stats, pretty_json
from ..reader.sidecars import SIDECAR_DIR, SIDECAR_KEYS, find_stats, manifest_digest, sidecar_path
from ..statistics import STATS_CHUNK, StatsAccumulator


def compute_stats(
    shards: reader.Shards, *, progress: bool | None = False, on_examples: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The stats.json object (protocol.md 2.6) of ``shards``, read shard by shard.

    The sums are taken exactly as the writer takes them (per shard, example by example,
    then added in shard order), so the result equals what ``ShardWriter(stats=True)`` would
    have written; padding is excluded by the ``lengths`` column when there is one. A
    float8_e4m3 cache's statistics are those of its dequantized values (float32).
    """
    md = shards.metadata
    lengths = shards.lengths
    total = StatsAccumulator(md.n_layers, md.d_model)
    start = 0
    float8 = shards.scales is not None
    with Progress(md.n_examples, f"stats {md.hash[:12]}", unit="examples", enabled=progress) as bar:
        for k, entry in enumerate(shards.manifest.shards):
            acts = shards.shard(k)
            scales = shards.scale_shard(k) if float8 else None
            part = StatsAccumulator(md.n_layers, md.d_model)
            for a in range(0, entry.n_examples, STATS_CHUNK):
                b = min(a + STATS_CHUNK, entry.n_examples)
                piece_lengths = None if lengths is None else lengths[start + a : start + b]
                part.update(acts[a:b], md.dtype, piece_lengths, None if scales is None else scales[a:b])
                bar.update(b - a)
                if on_examples is not None:
                    on_examples(b - a)
            total.add(part)
            start += entry.n_examples
    return total.summary(md.layers)


def write_sidecar(shards: reader.Shards, stats: dict[str, Any]) -> Path:
    """Write ``stats`` (from `compute_stats`) as the sidecar of ``shards``, atomically; its path.

    ``stats`` is checked against the schema and value rules of stats.json first (protocol.md
    2.6: what `find_stats` would refuse is never written), and the file lands only inside
    the root: ``.stats`` must be a folder there, never a link."""
    path = sidecar_path(shards)
    md = shards.metadata
    parse_stats(stats, md.layers, md.d_model, str(path), md.n_examples * md.tokens_per_ex)
    obj = {
        "cache": md.hash,
        "manifest_xxh3_128": manifest_digest(shards),
        "stats": stats,
        "stats_xxh3_128": xxhash.xxh3_128_hexdigest(pretty_json(stats)),
    }
    data = pretty_json(obj)
    _write_in_sidecar_folder(path, data)
    # A remote cache's sidecar goes beside it, in its root (protocol.md 6.1), where other readers look.
    shards.files.share_beside(_sidecar_name(shards), data)
    return path


def sidecar_location(shards: reader.Shards) -> str:
    """Where the statistics sidecar of ``shards`` lives, for people: a path, or a URL in a remote root."""
    return shards.files.beside(_sidecar_name(shards))


def _sidecar_name(shards: reader.Shards) -> str:
    """The sidecar's name in the root (``.stats/<hash>.json``: `sidecar_path` in the local root)."""
    return f"{SIDECAR_DIR}/{shards.metadata.hash}.json"


def _write_in_sidecar_folder(path: Path, data: bytes) -> None:
    """Write ``path`` (``<root>/.stats/<name>``) atomically, relative to a descriptor of the
    ``.stats`` folder opened without following links: nothing is written outside the root."""
    folder = path.parent
    with naming_disk_full(folder), contextlib.suppress(FileExistsError):
        os.mkdir(folder)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        found = file_kind(os.lstat(folder).st_mode)
        raise StatsFileError(
            f"{folder}: expected the folder of statistics sidecars, found {found}: sidecars are written only "
            "inside the root, never through a link; remove it, and run the command again"
        ) from None
    try:
        write_file_atomic(path, data, durable=True, dir_fd=fd)
    finally:
        os.close(fd)


def carry_sidecar(source: reader.Shards, copy: Path) -> bool:
    """Put the statistics sidecar of ``source`` beside its copy ``copy`` (``stage`` keeps them
    together), checked first; True if one was carried. A sidecar that fails its checks is
    left behind with a warning: the copy itself is good."""
    src = sidecar_path(source)
    dest = copy.parent / SIDECAR_DIR / src.name
    if source.manifest.stats is not None or not os.path.lexists(src) or os.path.lexists(dest):
        return False
    try:
        find_stats(source)
    except StatsFileError as err:
        warnings.warn(f"statistics sidecar not copied: {err}", stacklevel=2)
        return False
    _write_in_sidecar_folder(dest, src.read_bytes())
    return True


__all__ = [
    "SIDECAR_DIR",
    "SIDECAR_KEYS",
    "carry_sidecar",
    "compute_stats",
    "find_stats",
    "manifest_digest",
    "sidecar_location",
    "sidecar_path",
    "write_sidecar",
]
