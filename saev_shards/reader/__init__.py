"""Reading a cache: `open` a directory, get a `Shards`.

* `open`: validation up front, without reading shards (protocol.md section 7);
* `shards`: `Shards`, the facade: numpy-style indexing, layers by value, `verify`;
* `handles`: per-process memmaps and file descriptors, and pickling;
* `reads`: the ``pread`` fast paths (`read_example`, `read_range`, `read_vectors`);
* `sidecars`: labels, columns, text fields (`Fields`, `TextColumn`) and statistics,
  including the stats sidecar beside a cache (`find_stats`).

This package takes paths and never imports `saev_shards.store`: `saev_shards.open`
(`store.open_cache`) resolves a hash or a prefix first.
"""

from __future__ import annotations

from .open import PathLike, open
from .shards import Shards
from .sidecars import SIDECAR_DIR, Fields, TextColumn, find_stats, sidecar_path

__all__ = ["SIDECAR_DIR", "Fields", "PathLike", "Shards", "TextColumn", "find_stats", "open", "sidecar_path"]
