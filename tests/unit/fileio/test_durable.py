"""fileio.durable: small files written whole through a temporary name, or not at all."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


def test_write_file_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "meta.json"
    path.write_bytes(b"old")
    fileio.write_file_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_write_file_atomic_sets_the_mode_exactly_and_works_relative_to_a_folder(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fileio.write_file_atomic(tmp_path / "x", b"abc", dir_fd=fd, mode=0o640)
    finally:
        os.close(fd)
    assert (tmp_path / "x").read_bytes() == b"abc"
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o640
    fileio.write_file_atomic(tmp_path / "y", b"", durable=False, mode=0o444)
    assert (tmp_path / "y").stat().st_mode & 0o777 == 0o444


def test_write_file_atomic_never_writes_through_a_link_at_the_temporary_name(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    path = tmp_path / "x"
    (tmp_path / f"x.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(target)
    with pytest.raises(OSError) as info:
        fileio.write_file_atomic(path, b"evil")
    assert info.value.errno == errno.ELOOP
    assert target.read_bytes() == b"keep" and not path.exists()


def test_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "manifest.json"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ss.DiskFullError, match=r"manifest\.json: no space left on device.*; free some"):
        fileio.write_file_atomic(path, b"x" * 10, note="; free some")
    assert list(tmp_path.iterdir()) == []


def test_fsync_dir_accepts_a_folder_and_refuses_a_file(tmp_path: Path) -> None:
    fileio.fsync_dir(tmp_path)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fileio.fsync_dir(tmp_path / "f")
