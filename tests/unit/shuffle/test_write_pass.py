"""shuffle.write_pass: the index of every run's pieces, checked before a bucket is loaded; how the runs are read."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards.shuffle import plan_shuffle, run_plan
from saev_shards.shuffle.scatter import scatter
from saev_shards.shuffle.scratch import load_record, run_file
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


def test_runs_are_read_without_readahead_and_dropped_once_read(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run is opened once, with POSIX_FADV_RANDOM (the kernel's readahead would read the
    next buckets' pieces, evicted again under a small page cache before they are needed), and
    every page of each piece is dropped (POSIX_FADV_DONTNEED) once read: all of each run's pages
    but for its last partial one."""
    md = small_metadata(d_model=512, n_examples=23)  # pieces of several pages
    write_cache(root, md)
    plan = plan_shuffle(ss.open(root / md.hash), n_buckets=3, examples_per_chunk=5)
    calls: list[tuple[str, int, int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1]
        calls.append((name, offset, length, advice))
        real(fd, offset, length, advice)

    sizes: dict[str, int] = {}

    def step(kind: str, index: int) -> None:
        if kind == "scattered":  # the runs are removed once the output is published
            for c in range(plan.n_chunks):
                record = load_record(plan.work, c, plan.n_buckets, plan.layout)
                assert record is not None
                sizes[run_file(c)] = record.nbytes

    monkeypatch.setattr(os, "posix_fadvise", advise)
    out = run_plan(plan, durable=False, after_step=step)
    assert len(sizes) == plan.n_chunks > 1 and min(sizes.values()) > 2 * mmap.PAGESIZE
    for name, nbytes in sizes.items():
        mine = [c for c in calls if c[0] == name]
        assert [c[1:] for c in mine if c[3] == os.POSIX_FADV_RANDOM] == [(0, 0, os.POSIX_FADV_RANDOM)]
        dropped = sorted((a, a + n) for _, a, n, advice in mine if advice == os.POSIX_FADV_DONTNEED)
        page = mmap.PAGESIZE
        covered = 0
        for a, b in dropped:
            assert a % page == 0 and b % page == 0 and a <= covered
            covered = max(covered, b)
        assert covered == nbytes - nbytes % page
    assert out.n_examples == plan.n_tokens
