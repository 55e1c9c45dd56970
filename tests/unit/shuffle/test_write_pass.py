"""shuffle.write_pass: the index of every run's pieces, checked before a bucket is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards.shuffle import plan_shuffle
from saev_shards.shuffle.scatter import scatter
from saev_shards.shuffle.scratch import run_file
from saev_shards.shuffle.write_pass import RunIndex

from ...support.caches import small_metadata, write_cache


def test_the_index_places_each_bucket_and_refuses_a_missing_run(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md)
    plan = plan_shuffle(ss.open(root / md.hash), n_buckets=3, examples_per_chunk=5)
    plan.work.mkdir(parents=True)
    scatter(plan, list(range(plan.n_chunks)), lambda n: None, lambda c: None, durable=False)
    index = RunIndex(plan)
    assert index.bucket_first[0] == 0 and index.bucket_first[-1] == plan.n_tokens
    assert [index.rows(b) for b in range(3)] == index.counts.sum(axis=0).tolist()
    assert all(off[-1] == r.nbytes for off, r in zip(index.offsets, index.records, strict=True))
    (plan.work / run_file(2)).unlink()
    with pytest.raises(ss.ShuffleError, match=r"run000002\.bin: missing or incomplete; run the shuffle again"):
        RunIndex(plan)
