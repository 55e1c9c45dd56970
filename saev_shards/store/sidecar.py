"""Statistics for a cache written without them, kept beside it: the stats sidecar.

A published cache is immutable, so `saev-shards stats HASH` (`compute_stats` +
`write_sidecar`) does not add stats.json to it: it writes ``<root>/.stats/<hash>.json`` in
the root that holds the cache (protocol.md section 2.9), and `Shards.stats` reads it when
the cache has no stats.json of its own (`find_stats`). The file is a JSON object:

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

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from .. import reader
from ..errors import StatsFileError
from ..fileio import hash_file, write_file_atomic
from ..format import MANIFEST_FILE, pretty_json, read_json_file, stats_max_bytes
from ..progress import Progress
from ..protocol.v3 import parse_stats
from ..writer import STATS_CHUNK, _Stats

#: The folder of a shards root that holds sidecars (not a cache: `ls` and `resolve` skip it).
SIDECAR_DIR = ".stats"
SIDECAR_KEYS = ("cache", "manifest_xxh3_128", "stats", "stats_xxh3_128")


def sidecar_path(shards: reader.Shards) -> Path:
    """Where the statistics sidecar of ``shards`` lives: ``<root>/.stats/<hash>.json``."""
    return shards.path.parent / SIDECAR_DIR / f"{shards.metadata.hash}.json"


def _manifest_digest(shards: reader.Shards) -> str:
    return hash_file(shards.path / MANIFEST_FILE, regular_only=True)[1]


def find_stats(shards: reader.Shards) -> dict[str, Any] | None:
    """The sidecar statistics of ``shards`` (as `Shards.stats` returns them), None if there
    is no sidecar; `StatsFileError` if it exists but does not check out."""
    path = sidecar_path(shards)
    if not os.path.lexists(path):
        return None
    md = shards.metadata
    again = f"; remove it, or make it again with `saev-shards stats {md.hash[:12]} --force`"
    try:
        obj = read_json_file(path, stats_max_bytes(md.n_layers, md.d_model) + 4096)
    except (OSError, ValueError) as err:
        why = str(err).removeprefix(f"{path}: ")
        raise StatsFileError(f"{path}: unreadable statistics sidecar: {why}{again}") from None
    if not isinstance(obj, dict) or sorted(obj) != sorted(SIDECAR_KEYS):
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise StatsFileError(f"{path}: expected an object with keys {list(SIDECAR_KEYS)}, found {found}{again}")
    if obj["cache"] != md.hash:
        raise StatsFileError(f"{path}: cache: expected {md.hash}, found {obj['cache']!r}{again}")
    digest = _manifest_digest(shards)
    if obj["manifest_xxh3_128"] != digest:
        raise StatsFileError(
            f"{path}: manifest_xxh3_128: expected {digest} (of {shards.path / MANIFEST_FILE}), "
            f"found {obj['manifest_xxh3_128']!r}: computed for other data{again}"
        )
    found_digest = xxhash.xxh3_128_hexdigest(pretty_json(obj["stats"]))
    if obj["stats_xxh3_128"] != found_digest:
        raise StatsFileError(
            f"{path}: stats_xxh3_128: expected {obj['stats_xxh3_128']!r}, found {found_digest}: damaged{again}"
        )
    return parse_stats(obj["stats"], md.layers, md.d_model, str(path))


def compute_stats(
    shards: reader.Shards, *, progress: bool | None = False, on_examples: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The stats.json object (protocol.md 2.6) of ``shards``, read shard by shard.

    The sums are taken exactly as the writer takes them (per shard, example by example,
    then added in shard order), so the result equals what ``ShardWriter(stats=True)`` would
    have written; padding is excluded by the ``lengths`` column when there is one.
    """
    md = shards.metadata
    lengths = shards.lengths
    total = _Stats(md.n_layers, md.d_model)
    start = 0
    with Progress(md.n_examples, f"stats {md.hash[:12]}", unit="examples", enabled=progress) as bar:
        for k, entry in enumerate(shards.manifest.shards):
            acts = shards.shard(k)
            part = _Stats(md.n_layers, md.d_model)
            for a in range(0, entry.n_examples, STATS_CHUNK):
                b = min(a + STATS_CHUNK, entry.n_examples)
                piece_lengths = None if lengths is None else lengths[start + a : start + b]
                part.update(acts[a:b], md.dtype, piece_lengths)
                bar.update(b - a)
                if on_examples is not None:
                    on_examples(b - a)
            total.add(part)
            start += entry.n_examples
    return total.summary(md.layers)


def write_sidecar(shards: reader.Shards, stats: dict[str, Any]) -> Path:
    """Write ``stats`` (from `compute_stats`) as the sidecar of ``shards``, atomically; its path."""
    path = sidecar_path(shards)
    path.parent.mkdir(exist_ok=True)
    obj = {
        "cache": shards.metadata.hash,
        "manifest_xxh3_128": _manifest_digest(shards),
        "stats": stats,
        "stats_xxh3_128": xxhash.xxh3_128_hexdigest(pretty_json(stats)),
    }
    write_file_atomic(path, pretty_json(obj), durable=True)
    return path


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
    dest.parent.mkdir(exist_ok=True)
    write_file_atomic(dest, src.read_bytes(), durable=True)
    return True
