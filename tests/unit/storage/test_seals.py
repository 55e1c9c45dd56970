"""The block cache's seals (`storage.blockcache`): an entry checked once is trusted by its user
without being hashed again while it is the same file, unchanged; any change, a seal of
another user, or something else at a seal's name makes it hashed again. And a remote cache's
blocks read in place from the block cache (`RemoteFiles.map_pieces`)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import xxhash

from saev_shards.storage import blockcache
from saev_shards.storage.blockcache import BlockCache
from saev_shards.storage.remote import RemoteFiles
from saev_shards.storage.seals import SEAL_AFTER, SEAL_SUFFIX, seal_name

from .test_remote import DATA, MemoryClient

BODY = bytes(range(256)) * 16
KEY = xxhash.xxh3_128_hexdigest(BODY)


class Hashes:
    """Counts the hashes of entries (`blockcache.digest_of`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = blockcache.digest_of

        def counted(fd: int, nbytes: int) -> str:
            self.n += 1
            return real(fd, nbytes)

        monkeypatch.setattr(blockcache, "digest_of", counted)


def opened(cache: BlockCache) -> bool:
    fd = cache.open(KEY, len(BODY), KEY)
    if fd is None:
        return False
    assert os.pread(fd, len(BODY), 0) == BODY
    os.close(fd)
    return True


def seals(cache: BlockCache) -> list[str]:
    return sorted(p.name for p in cache.path(KEY).parent.iterdir() if p.name.endswith(SEAL_SUFFIX))


def test_an_entry_written_from_verified_bytes_is_never_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = Hashes(monkeypatch)
    fd = BlockCache(tmp_path).insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    for _ in range(3):  # a new process each time (a new BlockCache: nothing kept in memory)
        assert opened(BlockCache(tmp_path))
    assert hashes.n == 0
    assert seals(BlockCache(tmp_path)) == [seal_name(KEY, os.stat(BlockCache(tmp_path).path(KEY)))]


def test_an_entry_without_a_seal_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry of an earlier version (no seal) is hashed by the first process that opens it,
    which seals it; the next ones take it as it is."""
    cache = BlockCache(tmp_path)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    for name in seals(cache):
        os.unlink(cache.path(KEY).parent / name)
    hashes = Hashes(monkeypatch)
    assert opened(BlockCache(tmp_path)) and hashes.n == 1
    assert opened(BlockCache(tmp_path)) and opened(BlockCache(tmp_path)) and hashes.n == 1


@pytest.mark.parametrize("change", ["rewritten", "chmod", "replaced"])
def test_a_changed_entry_is_hashed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """Bytes rewritten in place (same size), a mode changed and changed back, or another file
    put at the entry's name: its change time or inode differs from the seal's, so it is hashed
    again, and discarded where its bytes are wrong."""
    cache = BlockCache(tmp_path)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    hashes = Hashes(monkeypatch)
    path = cache.path(KEY)
    if change == "rewritten":
        path.chmod(0o600)
        path.write_bytes(b"x" + BODY[1:])
        path.chmod(0o400)
    elif change == "chmod":
        path.chmod(0o600)
        path.chmod(0o400)
    else:
        (tmp_path / "other").write_bytes(BODY)
        (tmp_path / "other").chmod(0o400)
        os.replace(tmp_path / "other", path)
    assert opened(BlockCache(tmp_path)) == (change != "rewritten")
    assert hashes.n == 1
    if change == "rewritten":
        assert not path.exists()  # discarded, fetched again by the caller
    else:
        assert opened(BlockCache(tmp_path)) and hashes.n == 1  # sealed again as it is now


def test_a_writable_entry_is_never_taken_on_its_seal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = BlockCache(tmp_path)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    path = cache.path(KEY)
    os.chmod(path, 0o600)
    hashes = Hashes(monkeypatch)
    # The seal of its new state (a name anyone of this user could make) is no reason to trust a writable file.
    (path.parent / seal_name(KEY, os.stat(path))).touch()
    assert opened(BlockCache(tmp_path)) and hashes.n == 1
    assert stat.S_IMODE(path.stat().st_mode) == 0o400  # made read-only again


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user (root only)")
def test_a_seal_of_another_user_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = BlockCache(tmp_path)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    (name,) = seals(cache)
    os.chown(cache.path(KEY).parent / name, 65534, 65534)
    hashes = Hashes(monkeypatch)
    assert opened(BlockCache(tmp_path)) and hashes.n == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user (root only)")
def test_another_members_entry_is_sealed_only_once_it_has_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry of another user changed just now is hashed on every open; once it has not
    changed for `SEAL_AFTER` seconds before it is hashed, it is sealed."""
    cache = BlockCache(tmp_path)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    path = cache.path(KEY)
    for name in seals(cache):
        os.unlink(path.parent / name)
    os.chown(path, 65534, 65534)  # another member's entry, changed just now
    hashes = Hashes(monkeypatch)
    assert opened(BlockCache(tmp_path)) and opened(BlockCache(tmp_path)) and hashes.n == 2
    assert seals(cache) == []
    later = time.time() + SEAL_AFTER + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert opened(BlockCache(tmp_path)) and opened(BlockCache(tmp_path)) and hashes.n == 3


@pytest.mark.parametrize("what", ["link", "fifo", "folder"])
def test_something_else_at_a_seals_name_is_never_followed_nor_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    cache_dir = tmp_path / "cache"
    cache = BlockCache(cache_dir)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    path = cache.path(KEY)
    (name,) = seals(cache)
    seal = path.parent / name
    seal.unlink()
    outside = tmp_path / "outside"
    outside.write_text("keep")
    if what == "link":
        seal.symlink_to(outside)
    elif what == "fifo":
        os.mkfifo(seal)
    else:
        seal.mkdir()
    hashes = Hashes(monkeypatch)
    assert opened(BlockCache(cache_dir)) and hashes.n == 1  # hashed (and opened without blocking)
    assert outside.read_text() == "keep"
    assert seal.is_file() and not seal.is_symlink()  # replaced by a seal of this user
    assert opened(BlockCache(cache_dir)) and hashes.n == 1


def test_a_trim_removes_seals_with_their_entries_and_stale_ones(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, limit=1 << 20)
    fd = cache.insert(KEY, BODY)
    assert fd is not None
    os.close(fd)
    folder = cache.path(KEY).parent
    stale = folder / f"{KEY}.{os.geteuid()}.1.2{SEAL_SUFFIX}"  # of an entry replaced since
    stale.touch()
    assert cache.usage() == len(BODY)  # seals take no part in the size
    assert cache.trim(target=0.5) == 0 and not stale.exists() and len(seals(cache)) == 1
    assert cache.trim(target=0.0) == len(BODY)
    assert list(folder.iterdir()) == []


# -- a remote cache read in place ---------------------------------------------------------


def remote(tmp_path: Path, block_size: int) -> tuple[RemoteFiles, MemoryClient]:
    files = RemoteFiles(
        "s3://bucket/root/" + "a" * 64,
        {"f.bin": (len(DATA), xxhash.xxh3_128_hexdigest(DATA))},
        BlockCache(tmp_path),
    )
    client = MemoryClient(DATA)
    files.client = client
    digests = [xxhash.xxh3_128_hexdigest(DATA[i : i + block_size]) for i in range(0, len(DATA), block_size)]
    files.use_blocks(block_size, {"f.bin": digests}.get)
    return files, client


def read_pieces(pieces: list[tuple[int, int, int]] | None) -> bytes:
    assert pieces is not None
    out = bytearray(len(DATA))
    for fd, offset, nbytes in pieces:
        out[offset : offset + nbytes] = os.pread(fd, nbytes, 0)
        os.close(fd)
    return bytes(out)


def test_a_remote_file_is_read_in_place_once_its_blocks_are_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, client = remote(tmp_path, 4096)
    assert files.in_place and files.pieces_of(len(DATA)) == 2
    assert files.map_pieces("f.bin", len(DATA)) is None  # nothing fetched for it
    assert client.requests == []
    assert bytes(files.read("f.bin", 0, 100)) == DATA[:100]
    files.flush()
    assert files.map_pieces("f.bin", len(DATA)) is None  # the second block is not there yet
    assert bytes(files.read("f.bin")) == DATA
    files.flush()
    files.close_all()
    hashes = Hashes(monkeypatch)
    again, client = remote(tmp_path, 4096)  # a new process: the entries' seals, no hash
    pieces = again.map_pieces("f.bin", len(DATA))
    assert pieces is not None
    assert [(offset, nbytes) for _, offset, nbytes in pieces] == [(0, 4096), (4096, len(DATA) - 4096)]
    assert read_pieces(pieces) == DATA and hashes.n == 0 and client.requests == []
    again.close_all()


def test_a_damaged_block_is_never_read_in_place(tmp_path: Path) -> None:
    files, _ = remote(tmp_path, 4096)
    assert bytes(files.read("f.bin")) == DATA
    files.flush()
    files.close_all()
    entry = files.cache.path(xxhash.xxh3_128_hexdigest(DATA[4096:]))
    entry.chmod(0o600)
    entry.write_bytes(b"x" + DATA[4097:])
    again, _ = remote(tmp_path, 4096)
    assert again.map_pieces("f.bin", len(DATA)) is None
    assert not entry.exists()  # discarded: fetched again by the next read
    assert bytes(again.read("f.bin")) == DATA
    again.flush()
    assert read_pieces(again.map_pieces("f.bin", len(DATA))) == DATA
    again.close_all()


def test_blocks_off_a_page_boundary_are_not_mapped(tmp_path: Path) -> None:
    """Blocks smaller than a page (never in a valid manifest) cannot be mapped at their place."""
    files, _ = remote(tmp_path, 1000)
    assert bytes(files.read("f.bin")) == DATA
    files.flush()
    assert files.map_pieces("f.bin", len(DATA)) is None
    files.close_all()
