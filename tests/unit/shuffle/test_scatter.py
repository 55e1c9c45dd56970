"""shuffle.scatter: every chosen token of every chunk goes into one run, cut into one piece per
bucket in key order, and each run is sealed by its record."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards.shuffle import bucket_of, plan_shuffle, sort_keys
from saev_shards.shuffle.scatter import scatter
from saev_shards.shuffle.scratch import load_record

from ...support.caches import small_metadata, write_cache


def test_every_token_is_in_one_run_and_in_the_bucket_of_its_key(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md)
    plan = plan_shuffle(ss.open(root / md.hash), n_buckets=3, examples_per_chunk=5, seed=4)
    plan.work.mkdir(parents=True)
    rows: list[int] = []
    sealed: list[int] = []
    scatter(plan, list(range(plan.n_chunks)), rows.append, sealed.append, durable=False)
    assert sorted(sealed) == list(range(plan.n_chunks)) and sum(rows) == plan.n_tokens
    records = [load_record(plan.work, c, plan.n_buckets, plan.layout) for c in range(plan.n_chunks)]
    assert all(r is not None for r in records)
    counts = np.array([r.counts for r in records if r is not None])
    assert counts.sum() == plan.n_tokens
    # the tokens of each bucket are those whose key falls in it, however the chunks cut them
    keys = sort_keys(4, np.arange(plan.n_tokens, dtype=np.int64))
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(bucket_of(keys, 3), minlength=3))


def test_no_chunk_writes_nothing(root: Path) -> None:
    md = small_metadata(n_examples=5)
    write_cache(root, md)
    plan = plan_shuffle(ss.open(root / md.hash), n_buckets=2)
    scatter(plan, [], lambda n: None, lambda c: None, durable=False)
    assert not plan.work.exists()
