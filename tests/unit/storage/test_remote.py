"""The offset arithmetic of remote reads (`remote.files.RemoteFiles.preadv`), property-tested
against plain slicing of the file's bytes, per block and per whole file, with a server in
memory; and the block cache's rules (entries checked on open, a replaced entry kept)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import ChecksumMismatchError
from saev_shards.remote.blockcache import BlockCache
from saev_shards.remote.client import Client
from saev_shards.remote.files import RemoteFiles
from saev_shards.remote.url import is_url, join_url, split_roots, split_url

DATA = bytes((i * 7 + i // 251) % 256 for i in range(5000))


class MemoryClient(Client):
    """Serves one file from memory, in pieces of ``piece`` bytes; ``damage`` flips a byte of
    the next ``n`` answers, ``cut`` drops (or, negative, adds) bytes at the end of the next one."""

    def __init__(self, data: bytes, piece: int = 1000) -> None:
        super().__init__("s3://bucket/root")
        self.data = data
        self.piece = piece
        self.requests: list[tuple[int, int]] = []
        self.damage = 0
        self.cut = 0

    def stream(self, name: str, start: int, end: int, chunk: int = 0) -> Any:
        self.requests.append((start, end))
        body = bytearray(self.data[start:end])
        if self.damage and body:
            self.damage -= 1
            body[0] ^= 1
        if self.cut:
            body = body[: len(body) - self.cut] if self.cut > 0 else body + b"x" * -self.cut
            self.cut = 0
        for i in range(0, len(body), self.piece):
            yield bytes(body[i : i + self.piece])


def remote_file(tmp_path: Path, block_size: int | None) -> tuple[RemoteFiles, MemoryClient]:
    files = RemoteFiles(
        "s3://bucket/root/" + "a" * 64, {"f.bin": (len(DATA), xxhash.xxh3_128_hexdigest(DATA))}, BlockCache(tmp_path)
    )
    client = MemoryClient(DATA)
    files.client = client
    if block_size is not None:
        digests = [xxhash.xxh3_128_hexdigest(DATA[i : i + block_size]) for i in range(0, len(DATA), block_size)]
        files.use_blocks(block_size, {"f.bin": digests}.get)
    return files, client


@given(
    block_size=st.none() | st.sampled_from([1, 7, 64, 1000, 4999, 5000, 8192]),
    offset=st.integers(0, len(DATA) + 10),
    sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=4),
)
def test_preadv_equals_slicing(
    tmp_path_factory: pytest.TempPathFactory, block_size: int | None, offset: int, sizes: list[int]
) -> None:
    files, client = remote_file(tmp_path_factory.mktemp("bc"), block_size)
    views = [memoryview(bytearray(n)) for n in sizes]
    try:
        got = files.preadv(files.open("f.bin"), views, offset)
    finally:
        files.close_all()
    want = DATA[offset : offset + sum(sizes)]
    assert got == len(want)  # short only at the end of the file, as os.preadv
    assert b"".join(bytes(v) for v in views)[:got] == want
    if block_size is not None and got:  # only the blocks holding the bytes asked for, once per content
        first, last = offset // block_size, (offset + got - 1) // block_size
        blocks = [(i * block_size, min(len(DATA), (i + 1) * block_size)) for i in range(first, last + 1)]
        assert set(client.requests) <= set(blocks)
        assert len(client.requests) == len({DATA[a:b] for a, b in blocks})


def test_a_damaged_answer_is_fetched_again_and_a_damaged_file_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("saev_shards.storage.units.VERIFY_BACKOFF", 0.0)
    files, client = remote_file(tmp_path / "a", 64)
    client.damage = 1
    assert bytes(files.read("f.bin", 100, 110)) == DATA[100:110]
    assert files.refetched == 1 and len(client.requests) == 2
    files, client = remote_file(tmp_path / "b", 64)
    client.damage = 99
    with pytest.raises(
        ChecksumMismatchError, match=r"f\.bin: block 1 \(bytes 64-127\) does not match the manifest after 4"
    ):
        files.read("f.bin", 100, 110)


@pytest.mark.parametrize("cut", [5, -5])
def test_a_short_or_long_answer_is_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    monkeypatch.setattr("saev_shards.storage.units.VERIFY_BACKOFF", 0.0)
    files, client = remote_file(tmp_path, 4096)
    client.cut = cut
    assert bytes(files.read("f.bin", 100, 4000)) == DATA[100:4000]
    assert files.refetched == 1 and client.requests == [(0, 4096), (0, 4096)]
    files.close_all()


def test_fetched_blocks_are_stored_best_effort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified block is served at once and stored by the writer thread; when too many bytes
    wait for the disk it is served without being stored, and stored when fetched again."""
    files, client = remote_file(tmp_path, 4096)
    assert bytes(files.read("f.bin", 0, 5000)) == DATA
    files.close_all()  # waits for the writer
    digests = [xxhash.xxh3_128_hexdigest(DATA[:4096]), xxhash.xxh3_128_hexdigest(DATA[4096:])]
    for digest, nbytes in zip(digests, (4096, 904), strict=True):
        fd = files.cache.open(digest, nbytes, digest)
        assert fd is not None
        os.close(fd)
    assert files.skipped == 0

    monkeypatch.setattr("saev_shards.storage.units.MAX_PENDING_WRITES", 0)
    files, client = remote_file(tmp_path / "b", 4096)
    assert bytes(files.read("f.bin", 10, 4200)) == DATA[10:4200]
    files.close_all()
    assert (files.skipped, files.skipped_bytes) == (2, 5000)
    assert files.cache.open(digests[0], 4096, digests[0]) is None
    monkeypatch.setattr("saev_shards.storage.units.MAX_PENDING_WRITES", 1 << 20)
    assert bytes(files.read("f.bin", 0, 100)) == DATA[:100]  # fetched again, stored this time
    files.close_all()
    fd = files.cache.open(digests[0], 4096, digests[0])
    assert fd is not None and len(client.requests) == 3
    os.close(fd)


def test_a_stored_block_let_go_of_in_memory_is_read_through_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block this process fetched and stored keeps its entry's descriptor when its memory is
    let go of: read again from there, with no new request and no second check."""
    monkeypatch.setattr("saev_shards.storage.units.MAX_MEMORY", 0)
    files, client = remote_file(tmp_path, 4096)
    assert bytes(files.read("f.bin", 0, 100)) == DATA[:100]
    files.flush()  # block 0 stored; its entry now has a descriptor too
    opened: list[str] = []
    real_open = files.cache.open

    def counted_open(key: str, nbytes: int, digest: str) -> int | None:
        opened.append(key)
        return real_open(key, nbytes, digest)

    monkeypatch.setattr(files.cache, "open", counted_open)
    assert bytes(files.read("f.bin", 4096, 4200)) == DATA[4096:4200]  # block 0's memory let go of
    assert bytes(files.read("f.bin", 50, 4000)) == DATA[50:4000]
    assert client.requests == [(0, 4096), (4096, 5000)] and len(opened) == 1  # block 1's lookup only
    files.close_all()


def test_a_block_from_the_block_cache_is_checked_before_use(tmp_path: Path) -> None:
    """A new reader takes stored blocks from the block cache (no request), checked as read; a
    damaged entry is discarded and the block fetched again."""
    files, client = remote_file(tmp_path, 4096)
    assert bytes(files.read("f.bin")) == DATA
    files.close_all()
    again, client = remote_file(tmp_path, 4096)
    assert bytes(again.read("f.bin", 10, 5000)) == DATA[10:]
    assert client.requests == []
    again.close_all()
    path = again.cache.path(xxhash.xxh3_128_hexdigest(DATA[4096:]))
    path.chmod(0o644)
    path.write_bytes(b"x" + DATA[4097:])
    third, client = remote_file(tmp_path, 4096)
    assert bytes(third.read("f.bin", 4100, 4200)) == DATA[4100:4200]
    assert client.requests == [(4096, 5000)]
    third.close_all()


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


def test_urls() -> None:
    assert is_url("s3://bucket/x") and is_url("https://host/p") and not is_url("/scratch/s3://x") and not is_url("3f2a")
    assert not is_url(Path("s3://bucket"))
    assert split_url("s3://b/root/3f2a/") == ("s3://b/root", "3f2a")
    assert join_url("s3://b/root/", "/3f2a", "shards.json") == "s3://b/root/3f2a/shards.json"
    assert split_roots("/scratch/shards:s3://b/shards::https://h/p") == [
        "/scratch/shards",
        "s3://b/shards",
        "https://h/p",
    ]


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
