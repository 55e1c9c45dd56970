"""fileio.regular: a cache's files are opened only if they are regular files, never through a link."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import fileio


def test_open_regular_reads_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with fileio.open_regular(path) as f:
        assert f.read() == b"abc"


def test_open_regular_names_what_it_found_instead(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")  # never opened: opening a FIFO would block
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    for name, kind in [("dir", "a directory"), ("fifo", "a FIFO"), ("link", "a symbolic link")]:
        with pytest.raises(ss.NotRegularFileError, match=f"{name}: expected a regular file, found {kind}$"):
            fileio.open_regular(tmp_path / name)


def test_following_links_still_needs_a_regular_file_at_the_end(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "to_file").symlink_to(tmp_path / "f")
    (tmp_path / "to_dir").symlink_to(tmp_path)
    with fileio.open_regular(tmp_path / "to_file", follow_links=True) as f:
        assert f.read() == b"abc"
    with pytest.raises(ss.NotRegularFileError, match="found a directory \\(through a symbolic link\\)"):
        fileio.open_regular(tmp_path / "to_dir", follow_links=True)


def test_file_kind_names_every_kind(tmp_path: Path) -> None:
    assert fileio.file_kind(stat.S_IFREG | 0o644) == "a regular file"
    assert fileio.file_kind(stat.S_IFCHR) == "a character device"
    assert fileio.file_kind(stat.S_IFBLK) == "a block device"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "s"))
        assert fileio.file_kind(os.lstat(tmp_path / "s").st_mode) == "a socket"
    assert fileio.file_kind(0) == "a file of mode 0"
