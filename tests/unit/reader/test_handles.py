"""reader.handles: a cache's memmaps and descriptors, opened once per process, never shared
with a forked or unpickled copy, and given back by `close`."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import fileio

from ...support.caches import small_metadata, write_cache


@pytest.fixture
def opened(root: Path) -> tuple[ss.Shards, np.ndarray]:
    md = small_metadata(dtype="float8_e4m3")
    logical = write_cache(root, md)
    return ss.open(root / md.hash), logical


def test_shards_and_descriptors_are_opened_once(opened: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = opened
    md = shards.metadata
    first = shards.shard(1)
    assert first.shape == (md.examples_per_shard, *md.shard_shape[1:]) and not first.flags.writeable
    assert shards.shard(1) is first
    fd = shards.shard_fd(1)
    assert shards.shard_fd(1) == fd
    assert os.fstat(fd).st_size == shards.manifest.shards[1].nbytes
    assert shards.shard_path(1) == shards.path / "acts000001.bin"
    assert shards.scale_path(1) == shards.path / "scales000001.bin"
    scales = shards.scale_shard(1)
    assert scales.shape == (md.examples_per_shard, md.n_layers, md.tokens_per_ex) and scales.dtype == np.float32
    assert os.fstat(shards.scale_fd(1)).st_size == scales.nbytes


def test_close_gives_everything_back_and_use_takes_it_again(opened: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = opened
    fd = shards.shard_fd(0)
    assert fileio.take_lock(shards.path, directory=True) is None  # the shared lock is held
    shards.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    exclusive = fileio.take_lock(shards.path, directory=True)
    assert exclusive is not None  # nothing holds the folder now
    os.close(exclusive)
    np.testing.assert_array_equal(shards.shard(0), shards.raw[0 : shards.metadata.examples_per_shard])


def test_a_pickled_copy_opens_its_own_handles(opened: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = opened
    fd = shards.shard_fd(2)
    copy = pickle.loads(pickle.dumps(shards))
    assert copy.shard_fd(2) != fd
    np.testing.assert_array_equal(
        copy.read_example(11, 0, dtype="float32"), shards.read_example(11, 0, dtype="float32")
    )
    copy.close()
    assert os.fstat(fd).st_size > 0  # the original's descriptor is still open


def test_a_forked_child_never_uses_its_parents_descriptors(opened: tuple[ss.Shards, np.ndarray]) -> None:
    shards, _ = opened
    fd = shards.shard_fd(3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            ok = shards.shard_fd(3) != fd
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)


def test_a_collected_reader_never_waits_for_the_block_cache_writer() -> None:
    """`Shards.__del__` may run inside the garbage collector on any thread, even inside
    threading's bookkeeping; joining the writer there once deadlocked the suite, so it closes
    without waiting (the queued writes finish on their own thread)."""
    from saev_shards.reader.handles import ShardHandles

    calls: list[bool] = []

    class Files:
        url = "s3://bucket/root/x"

        def close_all(self, wait: bool = True) -> None:
            calls.append(wait)

    handles = ShardHandles.__new__(ShardHandles)
    handles.files = Files()  # type: ignore[assignment]
    handles._pid, handles._fds, handles._scale_fds = -1, {}, {}
    handles._reset = lambda: None  # type: ignore[method-assign]
    handles.__del__()
    handles.close()
    assert calls == [False, True]
