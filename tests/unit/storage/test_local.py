"""storage.local: a cache in a folder of this machine. A data file removed under an open reader
is a `CacheNotFoundError` saying so (the whole cache, or one file); empty arrays map to zeros;
the footprint counts regular files only; the shared folder lock is given back once; a copy
pickles as its path."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from saev_shards.errors import CacheNotFoundError
from saev_shards.fileio import IO_CHUNK
from saev_shards.storage.local import FolderLock, LocalFiles, removed_while_open


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    (path / "a.bin").write_bytes(bytes(range(256)) * 4)
    (path / "b.bin").write_bytes(b"")
    return path


def test_a_file_removed_while_open_is_named(folder: Path) -> None:
    files = LocalFiles(folder)
    (folder / "a.bin").unlink()
    for call in (lambda: files.open("a.bin"), lambda: files.read("a.bin"), lambda: files.open_file("a.bin")):
        with pytest.raises(CacheNotFoundError, match=r"a\.bin: missing: removed while the cache was open.*verify"):
            call()
    shutil.rmtree(folder)
    with pytest.raises(CacheNotFoundError, match=r"the cache was removed while open .*so b\.bin cannot be read"):
        files.map("b.bin", np.dtype(np.uint8), (4,))
    assert "b.bin cannot be read" in str(removed_while_open(folder, "b.bin"))


def test_reads_and_maps(folder: Path) -> None:
    files = LocalFiles(folder)
    data = (folder / "a.bin").read_bytes()
    assert files.read("a.bin") == data and files.read("a.bin", 10, 20) == data[10:20]
    assert files.read("a.bin", 1000, 2000) == data[1000:]
    fd = files.open("a.bin")
    try:
        assert files.size_now(fd) == len(data)
        view = memoryview(bytearray(7))
        assert files.preadv(fd, [view], 3) == 7 and bytes(view) == data[3:10]
    finally:
        files.close(fd)
    mapped = files.map("a.bin", np.dtype(np.uint8), (4, 256))
    assert not mapped.flags.writeable and bytes(mapped[1]) == data[256:512]
    empty = files.map("b.bin", np.dtype(np.float16), (0, 8))
    assert empty.shape == (0, 8) and empty.dtype == np.float16


def test_streams_reuse_one_buffer(folder: Path) -> None:
    files = LocalFiles(folder)
    pieces = [bytes(p) for p in files.stream("a.bin", 5)]
    assert b"".join(pieces) == (folder / "a.bin").read_bytes()[5:]
    assert len(files._spare) == 1 and files._spare[0].nbytes == IO_CHUNK
    files.close_all()
    assert files._spare == []


def test_the_footprint_counts_regular_files_only(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 5000)
    (folder / "link").symlink_to(tmp_path / "big")
    (folder / "sub").mkdir()
    assert LocalFiles(folder).footprint() == 1024


def test_where_things_are(folder: Path) -> None:
    files = LocalFiles(folder)
    assert files.url is None and files.location == str(folder) and files.local_root == folder.parent
    assert files.where("a.bin") == str(folder / "a.bin") and files.beside(".stats") == str(folder.parent / ".stats")
    copy = pickle.loads(pickle.dumps(files))
    assert copy.path == folder and copy._spare == []


def held(lock: FolderLock) -> int | None:
    return lock.fd


def test_the_folder_lock_is_given_back_once(folder: Path) -> None:
    lock = LocalFiles(folder).lock_folder()
    assert isinstance(lock, FolderLock) and lock.fd is not None
    lock.release()
    assert held(lock) is None
    lock.release()  # twice: nothing more to do
