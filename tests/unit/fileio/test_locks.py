"""fileio.locks: locks that exclude and share, and whose holder may delete them or the folder they lock."""

from __future__ import annotations

import os
from pathlib import Path

from saev_shards import fileio


def test_take_lock_excludes_and_shares(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    a = fileio.take_lock(path)
    assert a is not None
    assert fileio.take_lock(path) is None
    assert fileio.take_lock(path, shared=True) is None
    os.close(a)
    b, c = fileio.take_lock(path, shared=True), fileio.take_lock(path, shared=True)
    assert b is not None and c is not None
    assert fileio.take_lock(path) is None
    os.close(b)
    os.close(c)


def test_a_lock_deleted_by_its_holder_is_never_held_twice(tmp_path: Path) -> None:
    """B opened the lock file before A deleted it (A held it exclusively): once A lets go,
    the lock B gets is on the file at the path now, the same one C locks."""
    path = tmp_path / "x.lock"
    a = fileio.take_lock(path)
    assert a is not None
    stale = os.open(path, os.O_RDWR)  # what B opened before A deleted the file
    path.unlink()
    os.close(a)
    assert fileio.try_flock(stale)  # a plain flock of the deleted file succeeds...
    b = fileio.take_lock(path)  # ...take_lock locks the file at the path instead
    assert b is not None
    assert os.fstat(b).st_ino == path.stat().st_ino != os.fstat(stale).st_ino
    assert fileio.take_lock(path) is None  # C is excluded
    os.close(stale)
    os.close(b)


def test_take_lock_on_a_folder_follows_a_replacement(tmp_path: Path) -> None:
    folder = tmp_path / "partial"
    fd = fileio.take_lock(folder, directory=True)
    assert fd is not None and folder.is_dir()
    assert fileio.take_lock(folder, directory=True) is None
    os.rename(folder, tmp_path / "published")  # the holder publishes it and lets go
    os.close(fd)
    again = fileio.take_lock(folder, directory=True)  # a new folder at the name, not the renamed one
    assert again is not None and os.fstat(again).st_ino == folder.stat().st_ino
    os.close(again)
