"""shuffle.plan: a shuffle's arguments are checked when it is planned, each problem named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.shuffle import (
    plan_shuffle,
)

from ...support.caches import small_metadata, write_cache


def source(root: Path, **changes: Any) -> tuple[ss.Shards, np.ndarray[Any, Any], dict[str, Any]]:
    """A small source cache (23 examples, CLS + 4 tokens, 2 layers); returns it, its data and write kwargs."""
    kwargs: dict[str, Any] = {k: changes.pop(k) for k in ("labels", "lengths") if k in changes}
    md = small_metadata(**changes)
    logical = write_cache(root, md, **kwargs)
    return ss.open(root / md.hash), logical, kwargs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(layers=7), r"layers: expected values among the recorded layers \[6, 11\], found 7"),
        (dict(layers=[]), "layers: expected at least one"),
        (dict(layers=[6, 6]), r"layers: expected distinct values, found \[6, 6\]"),
        (dict(tokens="patches"), r"tokens: expected one of \['content', 'cls', 'all'\], found 'patches'"),
        (dict(seed=-1), r"seed: expected an integer in \[0, 2\*\*63\), found -1"),
        (dict(dtype="int8"), "dtype: expected one of"),
        (dict(memory_bytes=1000), "memory: 1,000 bytes is too small for this source: one example needs"),
        (dict(workers=0), "workers: expected an integer >= 1, found 0"),
        (dict(patches_per_shard=1), r"patches_per_shard: expected at least 2 \(one token at every chosen layer\)"),
    ],
)
def test_bad_arguments(root: Path, kwargs: dict[str, Any], message: str) -> None:
    src, _, _ = source(root)
    with pytest.raises(ss.ShuffleError, match=message):
        plan_shuffle(src, **kwargs)
