"""Reading a cache: `open` a directory, get a `Shards`.

* `open`: validation up front, without reading shards (protocol.md section 7), the files
  the manifest lists checked by `manifest_checks`;
* `shards`: `Shards`, the facade: numpy-style indexing, layers by value;
* `indexing`: numpy's indexing of the logical tensor across shard files (the loaders'
  datasets use it too);
* `handles`: per-process memmaps and file descriptors, and pickling;
* `reads`: the ``pread`` fast paths (`read_example`, `read_range`, `read_vectors`), the
  stored values and a float8_e4m3 cache's scales;
* `slices`: a span's chosen ``(example, layer)`` slices into a buffer at once (the loaders'
  cold path for a layer selection);
* `sidecars`: labels, columns, text fields (`Fields`, `TextColumn`) and statistics,
  including the stats sidecar beside a cache (`find_stats`);
* `verify`: every file read again and checked (`Shards.verify`);
* `summary`: the repr and the notebook table of a cache;
* `norms`: vector norms, the exact median norm per layer and the ``max_norm_multiple`` mask;
* `views`: dask, xarray and zarr over the shards without a copy (`Shards.to_dask`);
* `report`: one picture of a cache (`Shards.report`, ``saev-shards report``).

This package takes paths and never imports `saev_shards.store`: `saev_shards.open`
(`store.open_cache`) resolves a hash or a prefix first.
"""

from __future__ import annotations

from .open import PathLike, open
from .shards import Shards
from .sidecars import SIDECAR_DIR, Fields, TextColumn, find_stats, sidecar_path

__all__ = ["SIDECAR_DIR", "Fields", "PathLike", "Shards", "TextColumn", "find_stats", "open", "sidecar_path"]
