"""Writing a cache: `ShardWriter` stages it and publishes it atomically (protocol.md section 6).

* Everything goes to ``<root>/.staging-<HASH>/``; nothing appears at ``<root>/<HASH>``
  until every file is complete and fsynced, then one ``rename`` publishes it.
* Data arrives as *streams*: activations, and optionally labels, per-example numeric
  columns and per-example text. Each stream is cut at shard boundaries into per-shard
  part files. When every stream has covered a shard, a small part record
  (``part<06d>.json``) seals it, with sizes and xxh3_128 digests computed while writing.
* Sealed shards survive a crash: a writer opened with ``resume=True`` starts after the
  last sealed shard. Several writers (``rank``/``world_size``) each write a disjoint,
  contiguous block of shards into the same staging directory; `finalize` checks every
  part record, joins the per-shard parts into the final files and publishes.
* A lock file beside the staging directory, ``<root>/.staging-<HASH>.lock``, stays valid
  until the rename is done: a single writer or `finalize` holds it exclusively, each of
  several writers shares it. Every state a kill can leave resumes (protocol.md section 6).
* The output is a pure function of the data: the same input gives byte-identical
  files, however it was batched and however many writers produced it.

The modules, in the order data meets them:

* `shard_writer`: `ShardWriter`, the caller-thread API (checks, casts, reserves examples).
* `resume`: where a writer starts (lock, earlier runs cleared or kept, sealed shards).
* `streams`: the I/O thread: one loop cuts every stream into part files and seals shards.
* `stats`: per-shard statistics (`saev_shards.statistics`), summed in a thread of their own.
* `direct`: the O_DIRECT sequential file and its buffer pool (bytes to disk, nothing more).
* `finalize`: check the part records, join the parts, write the manifest, publish.
* `staging`: the lock of the staging directory (its names: `saev_shards.protocol.staging`).
* `space`: what a write still needs on disk (the up-front free-space checks of dump and convert).

Note: ``saev_shards.writer.finalize`` is the function; the module is reached with
``importlib.import_module("saev_shards.writer.finalize")`` (or ``from saev_shards.writer.finalize import ...``).
"""

from ..fileio import DIRECT_ALIGN
from .direct import DIRECT_BLOCK, DIRECT_IN_FLIGHT
from .finalize import finalize
from .shard_writer import ShardWriter, rank_shards, world_from_env
from .space import sealed_shards, space_needed

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_BLOCK",
    "DIRECT_IN_FLIGHT",
    "ShardWriter",
    "finalize",
    "rank_shards",
    "sealed_shards",
    "space_needed",
    "world_from_env",
]
