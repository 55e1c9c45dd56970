"""What a write still needs on disk, for the up-front free-space checks of `dump` and `convert`.

`sealed_shards` says which shards an earlier run left sealed in staging (a resumed writer
skips them); `space_needed` adds up the files a writer still writes: its unsealed shards
with their parts and part records, plus the joined columns and text of the whole cache
(finalizing writes them while the parts still exist), each rounded up to the filesystem's
allocation unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..fileio import bytes_on_disk
from ..protocol.common import MANIFEST_FILE
from ..protocol.metadata import Metadata
from ..protocol.staging import part_record, staging_dir
from .shard_writer import rank_shards

#: Lower bounds of the text files written for examples ``[a, b)``: one size per text field.
TextSizes = Callable[[int, int], list[int]]


def sealed_shards(root: Path, md: Metadata) -> list[int]:
    """Shards whose part record exists in staging (sealed, not re-verified); all of them
    once finalizing has written shards.json there (it then removes the part records)."""
    staging = staging_dir(root, md)
    if (staging / MANIFEST_FILE).exists():
        return list(range(md.n_shards))
    return [k for k in range(md.n_shards) if (staging / part_record(k)).exists()]


def space_needed(
    md: Metadata,
    root: Path,
    rank: int = 0,
    world_size: int = 1,
    *,
    columns: Mapping[str, tuple[Any, tuple[int, ...]]] | None = None,
    text: TextSizes | None = None,
    restart: bool = False,
) -> int:
    """Bytes writer ``rank`` of ``world_size`` still needs under ``root``: its shards (and
    their scale files, float8_e4m3) not yet sealed with their parts (``columns``: name ->
    (dtype, per-example shape); ``text``: lower bounds of the text files) and part records
    (with per-shard statistics), plus the joined columns and text of the whole cache; each
    file rounded up to the filesystem's allocation unit. The manifest and stats.json are not
    counted."""
    column_sizes = [np.dtype(dt).itemsize * math.prod(shape) for dt, shape in (columns or {}).values()]
    # A part record holds the shard's float64 sums per layer and dimension as JSON text,
    # about 25 bytes a number.
    record = 2 * md.n_layers * md.d_model * 25
    sealed = set() if restart else set(sealed_shards(root, md))
    eps = md.examples_per_shard
    scales = md.scales_nbytes // md.n_examples if md.n_examples else 0  # per example: float8's scale files
    files = [md.n_examples * size for size in column_sizes] + (text(0, md.n_examples) if text else [])
    for k in rank_shards(md.n_shards, rank, world_size):
        if k not in sealed:
            a, b = k * eps, min((k + 1) * eps, md.n_examples)
            files += [md.shard_nbytes(k), (b - a) * scales, record, *((b - a) * size for size in column_sizes)]
            files += text(a, b) if text else []
    return bytes_on_disk(files, root)
