"""storage.units: the verifiable pieces a remote cache is read in. An answer that is damaged,
short or long is fetched again (and a block that never matches named); a fetched block is
stored in the block cache best effort, and read through its entry once its memory is let go
of; a unit is described by its bytes and copied out from memory or from its entry."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import ChecksumMismatchError, FileSizeError
from saev_shards.fileio import aligned_buffer
from saev_shards.storage import units
from saev_shards.storage.units import Unit, copy_out, describe

from .test_remote import DATA, remote_file


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


def test_a_unit_is_described_by_its_block_and_bytes() -> None:
    assert describe(Unit("f.bin", "k", "d", 117440512, 16777216, 7)) == "block 7 (bytes 117440512-134217727)"
    assert describe(Unit("f.bin", "file-d", "d", 0, 5000, -1)) == "the whole file"


def test_a_mismatch_says_what_came() -> None:
    unit = Unit("f.bin", "k", "ab" * 16, 0, 64, 1)
    assert units._mismatch(unit, 60, "") == "60 bytes came instead of 64"
    assert units._mismatch(unit, 64, "cd" * 16) == f"xxh3_128 {'cd' * 16} instead of {'ab' * 16}"
    assert [units._fetches(n) for n in (1, 4)] == ["1 fetch", "4 fetches"]


@given(offset=st.integers(0, len(DATA)), n=st.integers(0, 700))
def test_copy_out_gives_the_same_bytes_from_memory_and_from_an_entry(
    tmp_path_factory: pytest.TempPathFactory, offset: int, n: int
) -> None:
    n = min(n, len(DATA) - offset)
    path = tmp_path_factory.mktemp("entry") / "e"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    try:
        for entry in (units._Entry(None, bytearray(DATA)), units._Entry(fd)):
            dest = memoryview(bytearray(n))
            copy_out(entry, dest, offset)
            assert bytes(dest) == DATA[offset : offset + n]
    finally:
        os.close(fd)


def test_an_entry_that_ends_early_is_a_file_size_error(tmp_path: Path) -> None:
    path = tmp_path / "e"
    path.write_bytes(DATA[:100])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FileSizeError, match="block cache entry ended early at byte 100"):
            copy_out(units._Entry(fd), memoryview(bytearray(50)), 60)
    finally:
        os.close(fd)


def test_the_pool_hands_out_a_buffer_filled_as_far_as_the_block_needs() -> None:
    """A buffer's pages are faulted in as far as blocks have filled it: a full block gets one
    filled that far where one is free (not the last given back, first filled by a file's short
    last block), a short one the last given back, and a new buffer only when none is free."""
    mib = 1 << 20
    pool = units._Pool(4 * mib, keep_bytes=16 * mib)
    full, short = pool.take(4 * mib), pool.take(mib)
    assert full is not short
    pool.give(full)
    pool.give(short)  # given back last
    assert pool.take(4 * mib) is full
    assert pool.take(mib) is short
    pool.give(short)
    assert pool.take(2 * mib) is short  # none filled that far free: the one filled furthest
    pool.give(short)
    pool.give(full)
    assert pool.take(2 * mib) is full  # both filled that far now: the last given back
    assert pool.take(4 * mib) is short
    fresh = pool.take(mib)
    assert fresh is not full and fresh is not short and len(fresh) == 4 * mib
    for buffer in (full, short, fresh):
        pool.give(buffer)
    pool.clear()


def test_the_pool_keeps_free_buffers_by_the_bytes_they_have_faulted_in() -> None:
    """Free buffers are kept while the bytes filled in them come to at most ``keep_bytes``
    (short blocks fill a buffer only in part); one given back beyond that is unmapped."""
    mib = 1 << 20
    pool = units._Pool(4 * mib, keep_bytes=6 * mib)
    taken = [pool.take(4 * mib), pool.take(mib), pool.take(mib), pool.take(mib)]
    for buffer in taken:
        pool.give(buffer)
    assert [b.closed for b in taken] == [False, False, False, True]  # 4 + 1 + 1 MiB kept
    assert pool.take(4 * mib) is taken[0] and pool.take(mib) is taken[2]
    pool.clear()
    assert taken[1].closed and not taken[0].closed  # taken[0] and taken[2] are still handed out


def test_a_later_cold_read_of_short_blocks_reuses_the_buffers_of_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that lets go of its units and reads them again (a later cold epoch) fetches
    into the buffers it filled the first time, even where most of its blocks are a file's
    short last block: no fresh memory to fault in (it was a fifth of a cold epoch's bytes)."""
    monkeypatch.setenv("SAEV_SHARDS_REMOTE_REQUESTS", "1")
    monkeypatch.setattr("saev_shards.storage.units.MAX_PENDING_WRITES", 0)  # nothing stored
    bodies = {f"f{i}.bin": bytes((b + 31 * i) % 256 for b in DATA) for i in range(4)}
    monkeypatch.setattr("saev_shards.storage.units.MAX_MEMORY", len(DATA) * len(bodies))  # all held
    made: list[int] = []
    real = aligned_buffer

    def counted(nbytes: int) -> Any:
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr("saev_shards.storage.units.aligned_buffer", counted)
    files, client = remote_file(tmp_path, 4096, bodies)
    try:
        for _ in range(3):
            for name, body in bodies.items():
                assert bytes(files.read(name, 0, len(body))) == body
            files.let_go()
        assert len(made) == 2 * len(bodies)  # the first read's buffers, and no more
        assert len(client.requests) == 3 * 2 * len(bodies)  # every read fetched: nothing was stored
    finally:
        files.close_all()
