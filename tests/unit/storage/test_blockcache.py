"""storage.blockcache: entries checked when opened (a damaged one discarded), sizes parsed from
the environment's spelling, a limit of 0 that writes nothing, and trims that remove the least
recently used entries with their seals."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import BlockCacheError
from saev_shards.storage import blockcache, folders, seals
from saev_shards.storage.blockcache import BlockCache, parse_limit, root_id

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def insert(cache: BlockCache, data: bytes) -> str:
    digest = xxhash.xxh3_128_hexdigest(data)
    fd = cache.insert(digest, data)
    assert fd is not None
    os.close(fd)
    return digest


def test_block_cache_entries_are_checked_when_opened(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    digest = xxhash.xxh3_128_hexdigest(b"hello")
    fd = cache.insert(digest, b"hello")
    assert fd is not None
    os.close(fd)
    fd = cache.open(digest, 5, digest)
    assert fd is not None and os.pread(fd, 5, 0) == b"hello"
    os.close(fd)
    path = cache.path(digest)
    path.chmod(0o644)
    path.write_bytes(b"jello")
    assert cache.open(digest, 5, digest) is None and not path.exists()  # damaged: discarded
    assert cache.open(digest, 5, digest) is None  # and simply missing now


@given(
    n=st.integers(0, 10**6),
    unit=st.sampled_from(sorted(UNITS)),
    suffix=st.sampled_from(["", "b", "B", "ib", "iB"]),
    upper=st.booleans(),
    space=st.sampled_from(["", " "]),
)
def test_a_size_in_any_of_its_spellings_is_its_bytes(n: int, unit: str, suffix: str, upper: bool, space: str) -> None:
    text = f" {n}{space}{unit.upper() if upper else unit}{suffix} "
    assert parse_limit(text) == n * UNITS[unit]


@pytest.mark.parametrize("text", ["", "-1", "1.5G", "10X", "G", "64 G B", "1" * 21, "0x10"])
def test_a_size_that_is_not_one_is_refused_naming_where_it_came_from(text: str) -> None:
    with pytest.raises(BlockCacheError, match=r"^\$SAEV_SHARDS_BLOCK_CACHE_BYTES: expected a size in bytes"):
        parse_limit(text)
    with pytest.raises(BlockCacheError, match=r"^--limit: expected a size"):
        parse_limit(text, "--limit")


@pytest.mark.parametrize("limit", [-1, True, 1.5, "1G"])
def test_a_limit_that_is_no_number_of_bytes_is_refused(tmp_path: Path, limit: object) -> None:
    with pytest.raises(BlockCacheError, match="block cache limit: expected a number of bytes >= 0"):
        BlockCache(tmp_path, limit=limit)  # type: ignore[arg-type]


def test_the_limit_comes_from_the_environment_when_not_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blockcache.LIMIT_ENV, "3M")
    assert BlockCache(tmp_path).limit == 3 << 20
    assert BlockCache(tmp_path, limit=5).limit == 5
    monkeypatch.setenv(blockcache.LIMIT_ENV, "lots")
    with pytest.raises(BlockCacheError, match="SAEV_SHARDS_BLOCK_CACHE_BYTES"):
        BlockCache(tmp_path)


def test_the_default_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(blockcache.CACHE_ENV, str(tmp_path / "mine"))
    assert blockcache.default_folder() == tmp_path / "mine"
    monkeypatch.delenv(blockcache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert blockcache.default_folder() == tmp_path / "xdg" / "saev-shards"


def test_a_limit_of_zero_writes_nothing(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path / "bc", limit=0)
    digest = xxhash.xxh3_128_hexdigest(b"hello")
    assert cache.disabled
    assert cache.insert(digest, b"hello") is None
    assert cache.open(digest, 5, digest) is None
    assert cache.trim() == 0
    assert not (tmp_path / "bc").exists()


def test_a_trim_removes_the_least_recently_used_entries_with_their_seals(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    keys = [insert(cache, bytes([i]) * 40) for i in range(3)]
    # Last uses: the first inserted is the most recent, the second the oldest.
    for key, when in zip(keys, (3_000_000, 1_000_000, 2_000_000), strict=True):
        folder = cache.path(key).parent
        for name in os.listdir(folder):
            if name.startswith(key):
                os.utime(folder / name, (when, when), follow_symlinks=False)
    assert sorted(cache.entries()) == [
        (1_000_000, 40, cache.path(keys[1])),
        (2_000_000, 40, cache.path(keys[2])),
        (3_000_000, 40, cache.path(keys[0])),
    ]
    assert cache.trim() == 0  # under its limit: nothing to do
    assert cache.trim(target=50 / (1 << 20)) == 80
    assert [path for _, _, path in cache.entries()] == [cache.path(keys[0])]
    left = {name for folder in (tmp_path / "blocks").iterdir() for name in os.listdir(folder)}
    assert left and all(name.startswith(keys[0]) for name in left), left  # no seal of a removed entry


def test_entries_are_named_by_their_digest_under_two_hex_digits(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    key = insert(cache, b"abc")
    assert cache.path(key) == tmp_path / "blocks" / key[-2:] / key
    assert cache.path(key).read_bytes() == b"abc"
    assert cache.usage() == 3


def test_a_root_id_is_a_stable_short_name() -> None:
    a = root_id("s3://bucket/root")
    assert a == root_id("s3://bucket/root") and len(a) == 16 and int(a, 16) >= 0
    assert a != root_id("s3://bucket/root2")


def test_an_entry_written_while_the_folder_is_removed_is_written_again_into_the_folder_made_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """``rm -rf`` of the block cache while a block is stored (a user emptying it, a benchmark
    between rounds): the entry is stored again in the folder made anew, with no warning and
    no pause of the cache's writes, and no descriptor is left open."""
    folder = tmp_path / "blocks"
    cache = BlockCache(folder, limit=1 << 20)
    removed: list[bool] = []
    original = folders.write_new_file

    def remove_once(fd: int, data: memoryview) -> None:
        if not removed:
            removed.append(True)
            shutil.rmtree(folder)
        original(fd, data)

    monkeypatch.setattr(blockcache, "write_new_file", remove_once)
    fds_before = len(os.listdir("/proc/self/fd"))
    digest = insert(cache, b"hello")
    assert removed == [True]
    assert not cache.paused and not recwarn.list
    assert len(os.listdir("/proc/self/fd")) == fds_before
    fd = cache.open(digest, 5, digest)
    assert fd is not None and os.pread(fd, 5, 0) == b"hello"
    os.close(fd)


def test_an_entry_whose_seal_cannot_be_written_leaves_no_descriptor_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk met by the seal (after the entry's rename): the cache trims and stores the
    entry again; the first attempt's descriptor is closed, not left behind."""
    cache = BlockCache(tmp_path / "blocks", limit=1 << 20)
    original = seals.write_seal
    failed: list[bool] = []

    def full_once(*args: Any) -> None:
        if not failed:
            failed.append(True)
            raise OSError(errno.ENOSPC, "No space left on device")
        original(*args)

    monkeypatch.setattr(blockcache, "write_seal", full_once)
    fds_before = len(os.listdir("/proc/self/fd"))
    digest = insert(cache, b"hello")
    assert failed == [True] and not cache.paused
    assert len(os.listdir("/proc/self/fd")) == fds_before
    fd = cache.open(digest, 5, digest)
    assert fd is not None and os.pread(fd, 5, 0) == b"hello"
    os.close(fd)
