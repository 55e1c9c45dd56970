"""ShardWriter: clear errors, nothing half-published, resumable, several writers, same bytes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.protocol.staging import staging_dir

from ...support.caches import float_input, labels_for, logical_tensor, small_metadata, tree_bytes, write_cache


def test_publishes_read_only(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md, labels=True)
    path = root / md.hash
    assert not staging_dir(root, md).exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o555
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o444
    assert sorted(p.name for p in path.iterdir()) == [
        "acts000000.bin", "acts000001.bin", "acts000002.bin", "acts000003.bin", "acts000004.bin",
        "blocks.json", "labels.bin", "metadata.json", "shards.json",
    ]  # fmt: skip


def test_too_many_examples(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((20, 2, 5, 8), np.float16))
    with pytest.raises(ss.WriterError, match=r"too many examples: 20 written \+ 4 in this batch > 23 expected"):
        w.write(np.zeros((4, 2, 5, 8), np.float16))
    w.write(np.zeros((3, 2, 5, 8), np.float16))  # the failed batch was not counted
    assert w.close() == root / md.hash


def test_closing_short_publishes_nothing(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((10, 2, 5, 8), np.float16))
    with pytest.raises(ss.WriterError, match=r"missing examples \(acts: 10 of 23 examples\); nothing was published"):
        w.close()
    assert not (root / md.hash).exists()


def test_missing_labels_publish_nothing(root: Path) -> None:
    md = small_metadata()
    acts = np.zeros(md.shape, np.float16)
    with pytest.raises(ss.WriterError, match="labels: 5 of 23"), ss.ShardWriter(root, md, durable=False) as w:
        w.write(acts)
        w.write_labels(labels_for(md)[:5])
    assert not (root / md.hash).exists()


def test_exception_inside_with_publishes_nothing(root: Path) -> None:
    md = small_metadata()
    with pytest.raises(RuntimeError, match="boom"), ss.ShardWriter(root, md, durable=False) as w:
        w.write(np.zeros(md.shape, np.float16))
        raise RuntimeError("boom")
    assert not (root / md.hash).exists()


def test_buffers_may_be_reused_after_write(root: Path) -> None:
    """With background writes, the caller may overwrite its batch buffer right after write()."""
    md = small_metadata()
    logical = logical_tensor(md)
    buf = np.empty((1, *md.shape[1:]), np.float16)
    with ss.ShardWriter(root, md, background=True, durable=False) as w:
        for i in range(md.n_examples):
            buf[:] = logical[i]
            w.write(buf)
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


def test_empty_cache(root: Path) -> None:
    md = small_metadata(n_examples=0)
    with ss.ShardWriter(root, md) as w:
        pass
    shards = ss.open(w.path)
    assert shards.shape == (0, 2, 5, 8)
    assert shards[:].shape == (0, 2, 5, 8)
    assert shards.manifest.shards == ()


def test_several_writers_equal_one(tmp_path: Path) -> None:
    """3 ranks writing disjoint shard blocks, then finalize: byte-identical to a single writer."""
    md = small_metadata()
    lengths = (np.arange(md.n_examples) % 5 + 1).astype(np.int16)
    single = write_cache(tmp_path / "one", md, labels=True, lengths=lengths, text=True, stats=True)
    source = float_input(md, single)
    labels = labels_for(md)
    root = tmp_path / "three"
    writers = [ss.ShardWriter(root, md, rank=r, world_size=3, stats=True, durable=False) for r in range(3)]
    assert [(w.start, w.stop) for w in writers] == [(0, 5), (5, 15), (15, 23)]
    with pytest.raises(ss.WriterBusyError, match="writers are still running"):
        ss.finalize(root, md)
    for w in reversed(writers):  # order does not matter
        for a in range(w.start, w.stop, 3):
            b = min(a + 3, w.stop)
            w.write(
                source[a:b],
                labels=labels[a:b],
                columns={"lengths": lengths[a:b]},
                text={"prompt": [f"example {i}: é" for i in range(a, b)]},
            )
        assert w.close() is None
    assert not (root / md.hash).exists()
    assert ss.finalize(root, md) == root / md.hash
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "one" / md.hash)


def test_rank_from_environment(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    md = small_metadata()
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "6")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    w = ss.ShardWriter(root, md, durable=False)
    assert (w.rank, w.world_size) == (1, 2)
    w.abort()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    w = ss.ShardWriter(root, md, durable=False)
    assert (w.rank, w.world_size, w.start, w.stop) == (0, 3, 0, 5)
    w.abort()
    with pytest.raises(ss.WriterError, match="give both rank and world_size"):
        ss.ShardWriter(root, md, rank=1)


def test_writer_repr_and_durable_default(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md)
    assert w.durable
    assert "rank=0/1, examples [0, 23), next=0" in repr(w)
    w.abort()
    assert os.path.isdir(staging_dir(root, md))


def test_stats_need_lengths_with_the_activations(root: Path) -> None:
    md = small_metadata()
    acts = np.zeros((2, *md.shape[1:]), np.float16)
    w = ss.ShardWriter(root, md, stats=True, durable=False)
    with pytest.raises(ss.WriterError, match="lengths must come with their activations"):
        w.write_columns(lengths=np.array([1, 2]))
    w.write(acts, columns={"lengths": np.array([1, 2])})
    with pytest.raises(ss.WriterError, match="pass lengths with every batch of activations or with none"):
        w.write(acts)
    w.abort()
