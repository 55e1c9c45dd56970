"""A cache removed under a live reader (``saev-shards rm --force``, run as a user would, in a
subprocess): the reader's next file to open ends in `CacheNotFoundError` saying the cache was
removed while open, never a bare `FileNotFoundError`; what it had open still reads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss

from ..support.caches import small_metadata, write_cache

READS: dict[str, Callable[[ss.Shards], Any]] = {
    "index": lambda s: s[10],
    "read_example": lambda s: s.read_example(12, 0),
    "read_range": lambda s: s.read_range(14, 16),
    "labels": lambda s: s.labels,
    "columns": lambda s: s.columns["lengths"],
    "text": lambda s: s.text["prompt"][3],
    "scales": lambda s: s.scales[20] if s.scales is not None else s.read_vectors([21], [0], [1]),
}


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_a_reader_of_a_cache_removed_with_force_is_told_so(tmp_path: Path, dtype: str) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    md = small_metadata(dtype=dtype)
    lengths = np.arange(md.n_examples) % md.tokens_per_ex + 1
    logical = write_cache(root, md, labels=True, lengths=lengths, text=True)
    shards = ss.open(root / md.hash)
    first = np.asarray(shards[0:5])  # shard 0 is open now
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}, "SAEV_SHARDS_ROOT": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "saev_shards", "rm", md.hash[:8], "--yes", "--force"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert not (root / md.hash).exists()
    for what, read in READS.items():
        with pytest.raises(ss.CacheNotFoundError, match="the cache was removed while open") as err:
            read(shards)
        assert str(root / md.hash) in str(err.value) and "\n" not in str(err.value), what
    np.testing.assert_array_equal(shards[0:5], first)  # what it had open still reads
    np.testing.assert_array_equal(first, logical[0:5].astype(first.dtype))
