"""shuffle.plan: a shuffle's arguments are checked when it is planned, each problem named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.protocol.manifest import Manifest, ShardEntry, ShardList
from saev_shards.shuffle import (
    plan_shuffle,
)
from saev_shards.shuffle.plan import MIN_BUCKETS, MIN_CHUNK_BYTES, MIN_CHUNKS, MIN_PIECE

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


def described(n_examples: int, **changes: Any) -> ss.Shards:
    """A ViT-B/16-shaped cache (2 layers x 197 tokens x 768 float16) with no files behind it:
    planning reads none but a lengths column, which it has not."""
    md = small_metadata(n_examples=n_examples, patches_per_ex=196, d_model=768, patches_per_shard=200_000, **changes)
    entries = ShardList.of(
        ShardEntry(f"acts{k:06d}.bin", md.shard_n_examples(k), md.shard_n_examples(k) * md.example_nbytes, None)
        for k in range(md.n_shards)
    )
    return ss.Shards(Path("/nonexistent") / md.hash, md, Manifest(shards=entries))


@pytest.mark.parametrize(
    ("n_examples", "memory", "layers", "chunks", "buckets"),
    [
        # 3.6 GB under 1 GiB: the budget alone gives 7 chunks and 4 buckets (one layer), 14 and 8 (both)
        (6_000, 1 << 30, 11, 32, 16),
        (6_000, 1 << 30, None, 32, 16),
        # 36 MB: chunks of 16 MiB read at least (28 examples), buckets as many as 1 MiB pieces allow
        (60, 1 << 30, None, 3, 11),
        # 36 GB under 256 MiB: the budget cuts both passes finer than the floors do
        (60_000, 256 << 20, None, 583, 452),
    ],
)
def test_each_pass_is_cut_into_enough_steps_to_overlap_its_reads_and_writes(
    tmp_path: Path, n_examples: int, memory: int, layers: int | None, chunks: int, buckets: int
) -> None:
    """Chunks as large as the budget allows but at most a 32nd of the source (and 16 MiB read at
    least); buckets as few as the budget allows but 16 where pieces of 1 MiB on average allow it.
    Given sizes still win, and the output is the same whatever the cut (test_run)."""
    src = described(n_examples)
    plan = plan_shuffle(src, tmp_path, memory_bytes=memory, layers=layers)
    assert (plan.n_chunks, plan.n_buckets) == (chunks, buckets)
    read = plan.examples_per_chunk * src.metadata.example_nbytes // (1 if layers is None else 2)
    assert plan.n_chunks >= MIN_CHUNKS or read >= MIN_CHUNK_BYTES or plan.n_chunks == 1
    assert plan.n_buckets >= MIN_BUCKETS or plan.piece_nbytes < 2 * MIN_PIECE
    given = plan_shuffle(src, tmp_path, memory_bytes=memory, layers=layers, n_buckets=3, examples_per_chunk=1000)
    assert (given.n_buckets, given.examples_per_chunk) == (3, 1000)
