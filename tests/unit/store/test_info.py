"""store.info: what ``saev-shards info`` shows of a cache, as plain JSON values, no checksum read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards import store

from ...support.caches import small_metadata, write_cache


def test_the_summary_holds_the_metadata_files_and_statistics(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md, stats=True, lengths=np.full(md.n_examples, 5, np.int32))
    shards = ss.open(root / md.hash)
    info = store.summary(shards)
    assert json.loads(json.dumps(info)) == info  # plain JSON values
    assert (info["hash"], info["path"], info["url"]) == (md.hash, shards.location, None)
    assert (info["protocol"], info["dialect"], info["dtype"], info["read_dtype"]) == (
        "3.1",
        "3.1",
        "float16",
        "float16",
    )
    assert info["shape"] == [23, 2, 5, 8] and info["layers"] == [6, 11] and info["n_shards"] == 5
    assert [s["name"] for s in info["shards"]] == [f"acts{k:06d}.bin" for k in range(5)]
    assert sum(s["n_examples"] for s in info["shards"]) == 23
    assert info["columns"] == {"lengths": {"dtype": "int32", "shape": [23]}}
    assert [s["layer"] for s in info["stats"]] == [6, 11] and all(s["count"] == 115 for s in info["stats"])
    assert info["stats_file"] == str(shards.path / "stats.json")
    assert info["disk_nbytes"] > info["nbytes"] == md.nbytes


def test_a_cache_without_statistics_says_so(root: Path) -> None:
    md = small_metadata(n_examples=3)
    write_cache(root, md)
    info = store.summary(ss.open(root / md.hash))
    assert info["stats"] is None and info["labels"] is None and info["text"] == {}
