"""store.sidecar: statistics computed for a cache written without them are the ones the writer
would have written, kept beside it in the root and found by `Shards.stats`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards import store
from saev_shards.store import sidecar

from ...support.caches import small_metadata, write_cache


def test_the_sidecar_holds_what_the_writer_would_have_written(tmp_path: Path) -> None:
    md = small_metadata()
    lengths = np.array([5, 3, 1, 0, 4] * 4 + [2, 5, 5], np.int32)
    with_stats, without = tmp_path / "a", tmp_path / "b"
    write_cache(with_stats, md, lengths=lengths, stats=True)
    write_cache(without, md, lengths=lengths)
    written = json.loads((with_stats / md.hash / "stats.json").read_bytes())
    shards = ss.open(without / md.hash)
    assert shards.stats is None
    computed = store.compute_stats(shards)
    assert computed == written
    path = store.write_sidecar(shards, computed)
    assert path == without / ".stats" / f"{md.hash}.json"
    assert sidecar.sidecar_location(shards) == str(path)
    found = ss.open(without / md.hash).stats
    assert found is not None and set(found) == set(written)
    for key, value in written.items():
        np.testing.assert_array_equal(found[key], value)


def test_a_sidecar_copied_with_its_cache_stays_beside_it(tmp_path: Path) -> None:
    md = small_metadata(n_examples=4)
    write_cache(tmp_path / "a", md)
    shards = ss.open(tmp_path / "a" / md.hash)
    store.write_sidecar(shards, store.compute_stats(shards))
    copy = tmp_path / "b" / md.hash
    copy.parent.mkdir()
    assert sidecar.carry_sidecar(shards, copy)
    assert (tmp_path / "b" / ".stats" / f"{md.hash}.json").read_bytes() == (
        tmp_path / "a" / ".stats" / f"{md.hash}.json"
    ).read_bytes()
